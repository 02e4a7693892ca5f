"""Gateway agents end to end on the CPU (Ray, megatron-core, the hf engine): `trainer.mode=one_step_off`, whose
rollout thread streams the agents' groups (megarl/sampler.py AsyncSampler), trains on the rows they recorded, with the
rewards they returned; the synchronous loop's path is the same rollout entry (RolloutWorker.run_agents)."""

import json
from pathlib import Path

from openai import OpenAI

from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir

ROOT = Path(__file__).resolve().parent.parent


def agent(base_url, api_key, row):
    """Two turns, then the same history with its question edited (a second segment); 0.25 or 0.75 by the first
    answer's length, rewards no built-in reward gives."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message
    messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages[0] = {"role": "user", "content": row["prompt"] + "!"}
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 0.25 + 0.5 * (len(first.content) % 2)


def test_one_step_off_trains_on_what_gateway_agents_recorded(tmp_path, ray_local):
    cfg = tiny_config([f"agent.gateway.function={Path(__file__).resolve()}:agent", "agent.enabled=true",
                       "agent.max_response_tokens=40", "data.prompts_per_step=2", "rollout.n_samples=2",
                       "trainer.mode=one_step_off", "trainer.steps=2", "trainer.eval_every=0", "data.val_size=2",
                       "reward.name=exact_match", "trainer.loggers=jsonl", f"trainer.output_dir={tmp_path}"])
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (run_dir(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2
    for step in steps:
        assert step["agent/agents"] == 4 and step["agent/requests"] == 12 and step["agent/agents_crashed"] == 0
        assert step["agent/segments"] == 8 and step["agent/segments_edited"] == 4
        # every row's reward is its agent's 0.25 or 0.75: exact_match would give 0 or 1
        assert 0.25 <= step["train/reward"] <= 0.75 and step["train/reward_failures"] == 0
        assert step["agent/model_tokens_total"] > 0

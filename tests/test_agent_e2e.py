"""The calculator-tool recipe end to end on CPU (Ray, megatron-core, the HF engine, the agent loop): SFT on
multi-turn traces (direct answers and calculator calls), GRPO steps with over-sampling, a rollout dump,
and a replay of that dump that trains to the same numbers bit for bit."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "tool_calculator.yaml"


def run(cfg) -> list[dict]:
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in (run_dir(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_tool_recipe_dumps_over_samples_and_replays_bit_for_bit(tmp_path, ray_local):
    traces = tmp_path / "traces.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tool_traces.py"), "--out", str(traces), "--n", "64"],
                   check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    # the warm start's mix: answers without the tool, and calculator calls whose result is the answer
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    direct = [r for r in rows if len(r["messages"]) == 1]
    assert 0.4 < len(direct) / len(rows) < 0.8 and all(r["messages"][0]["content"] == r["answer"] for r in direct)
    for r in rows:
        if len(r["messages"]) > 1:
            assert [m["role"] for m in r["messages"]] == ["assistant", "tool", "assistant"]
            assert r["prompt"].rstrip("=") in r["messages"][0]["content"]
            assert r["messages"][1]["content"] == r["messages"][2]["content"] == r["answer"]
    dump = tmp_path / "dump"
    common = [f"sft.data={traces}", "sft.steps=4", "sft.batch_size=8", "data.prompts_per_step=2",
              "rollout.n_samples=2", "data.val_size=2", "trainer.steps=2", "trainer.eval_every=2",
              "trainer.loggers=jsonl", "agent.max_concurrent=4"]
    original = run(tiny_config(common + [f"trainer.output_dir={tmp_path / 'run'}", f"rollout.dump_dir={dump}",
                                                 "agent.oversample_groups=3"], path=RECIPE))
    steps = {r["step"]: r for r in original if "train/loss" in r}

    # over-sampling: 5 groups started, 2 kept; the aborted ones come back the next step with their old version
    assert steps[1]["agent/groups_started"] == 5 and steps[1]["agent/groups_resumed"] == 0
    assert steps[2]["agent/groups_resumed"] == steps[1]["agent/groups_aborted"]
    assert steps[2]["agent/groups_started"] == 5
    second = torch.load(dump / "step_000002.pt", weights_only=False)
    assert (second["tensors"]["policy_version"] < 1).sum().item() == steps[2]["agent/stale_samples"]

    # the dump: every trajectory, its masks exactly on the model's turns, tool results outside the loss
    first = torch.load(dump / "step_000001.pt", weights_only=False)
    t = first["tensors"]
    assert len(first["non_tensors"]["trajectory"]) == 4 and set(t) >= {"tokens", "loss_mask", "rollout_logprobs",
                                                                       "rewards", "policy_version"}
    for row, summary in enumerate(first["non_tensors"]["trajectory"]):
        prompt_len = int(t["attention_mask"][row].sum() - sum(e - s for turn in summary["turns"]
                                                              for s, e in [turn["span"]]))
        model = [p for turn in summary["turns"] if turn["role"] == "assistant"
                 for p in range(prompt_len + turn["span"][0], prompt_len + turn["span"][1])]
        assert t["loss_mask"][row].nonzero()[:, 0].tolist() == model
        tool = [p for turn in summary["turns"] if turn["role"] == "tool"
                for p in range(prompt_len + turn["span"][0], prompt_len + turn["span"][1])]
        assert t["loss_mask"][row, tool].sum() == 0 and t["rollout_logprobs"][row, tool].abs().sum() == 0
    assert (dump / "val_000000.pt").exists() and (dump / "val_000002.pt").exists()

    # replay: no generation for training, the same losses, gradients and rewards to the last bit
    replayed = run(tiny_config(common + [f"trainer.output_dir={tmp_path / 'replay'}",
                                                 f"rollout.replay_dir={dump}"], path=RECIPE))
    again = {r["step"]: r for r in replayed if "train/loss" in r}
    for step in (1, 2):
        train = {k: v for k, v in steps[step].items() if k.startswith("train/")}
        assert train and {k: again[step][k] for k in train} == train

"""verl's GSM8K PPO quickstart, its keys as verl's documentation writes them (sizes scaled to a CPU and a tiny model),
run by `python -m megarl.train`: it trains PPO with a critic, one sample per prompt, verl's lengths and batch
sizes, as the run's own log and metrics say."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.models.tiny import build_tiny_model
from megarl.utils.tracking import run_dir

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a chat template for the character tokenizer


def gsm8k_layout(path: Path, n: int, split: str) -> None:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {i} + {i % 7}? Answer after ####."}],
             "reward_model": {"style": "rule", "ground_truth": str(i + i % 7)},
             "extra_info": {"split": split, "index": i}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_verls_ppo_quickstart_trains_ppo_with_a_critic(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    gsm8k_layout(tmp_path / "train.parquet", 24, "train")
    gsm8k_layout(tmp_path / "test.parquet", 4, "test")
    command = [
        f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/test.parquet",
        "data.train_batch_size=16", "data.max_prompt_length=64", "data.max_response_length=24",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-5",
        f"critic.model.path={model}", "critic.ppo_micro_batch_size_per_gpu=4", "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=['console','file']", "trainer.val_before_train=False", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.save_freq=10", "trainer.test_freq=10", "trainer.total_epochs=1",
        "trainer.device=cpu", f"trainer.default_local_dir={tmp_path}/checkpoints",
        "trainer.project_name=quickstart", f"trainer.experiment_name={tmp_path.name}"]
    run = subprocess.run([sys.executable, "-m", "megarl.train", *command], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600)
    log = run.stdout
    assert run.returncode == 0, log[-3000:] + run.stderr[-3000:]
    assert log.splitlines()[0].startswith("profile: verl")
    # verl's quickstart: GAE with a critic, the dual-clip loss, one sample, its lengths, batch and mini-batch;
    # 24 prompts // 16 a step = 1 step in the one epoch (verl drops the partial batch)
    for said in ("algorithm: gae advantages with a critic", "policy loss dual_clip",
                 "samples: 1 per prompt", "prompts up to 64 tokens, responses up to 24 tokens",
                 "batch: 16 prompts = 16 sequences per RL step; mini-batch 8 sequences (8 prompts); 2 optimizer step(s)",
                 "micro-batch 4 sequences", "steps: 1 RL steps", "no KL to the reference"):
        assert said in log, said
    out = tmp_path / "runs" / "quickstart" / tmp_path.name
    rows = [json.loads(line) for line in (run_dir(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1]
    assert all(any(k.startswith("critic/") for k in r) for r in steps), sorted(steps[0])
    assert "held-out reward" in log

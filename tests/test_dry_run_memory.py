"""The dry run ends with the planner's memory for the run's own settings: the policy's training peak per GPU at
its layout and micro-batches (micro_batch_size rows of the longest prompt plus the response budget), and each SGLang
rank's weights; the numbers are megarl.reshard's for the same inputs, and they move with the settings."""

import re

from megarl.config.tiny import TINY_ARGS
from megarl.models.tiny import build_char_tokenizer
from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import GenLayout
from megarl.reshard.memory import GiB, MemorySettings, predict_peak
from megarl.reshard.plan import generation_bytes, load_model_config, train_layout
from megarl.train import main
from tests.models.hf_families import deepseek_v3_config, save_random

BATCH = ["data.prompts_per_step=4", "rollout.n_samples=4", "rollout.engine=sglang", "rollout.max_new_tokens=40"]


def _line(capsys, args) -> str:
    capsys.readouterr()
    assert main(["--dry-run", *TINY_ARGS] + args) == 0
    out = capsys.readouterr().out
    return next(line for line in out.splitlines() if line.startswith("predicted GPU memory"))


def test_dry_run_predicts_the_runs_memory_as_the_planner_does(tmp_path, capsys):
    model = save_random(deepseek_v3_config(layers=3, first_k_dense_replace=1), tmp_path / "v3", seed=3)
    build_char_tokenizer().save_pretrained(model)
    capsys.readouterr()
    assert main(["--dry-run", *TINY_ARGS, f"model.path={model}"] + BATCH) == 0
    out = capsys.readouterr().out
    longest = int(re.search(r"the longest (\d+) tokens", out).group(1))
    hf = load_model_config(str(model))
    layout = dict(tp=2, pp=1, cp=1, dp=1, ep=1, etp=2)
    args = [f"model.path={model}", "actor.parallel.world_size=2", "actor.parallel.tp=2", "actor.micro_batch_size=4",
            "rollout.sglang_tp=2", "actor.recompute=full"] + BATCH
    line = _line(capsys, args)
    settings = MemorySettings(seq_len=longest + 40, micro_batch=4, sequence_parallel=False, recompute="full")
    peak = predict_peak(hf, train_layout(hf, layout), settings)
    weights = max(generation_bytes(hf_inventory(hf), GenLayout(2), r) for r in range(2))
    assert f"training peak {peak / GiB:.2f} GiB per GPU at micro-batches of 4 x {longest + 40} tokens" in line, line
    assert f"SGLang weights {weights / GiB:.2f} GiB per rank at TP=2 EP=1" in line, line
    # a token budget sets the micro-batch; no recompute keeps more activations
    budget = _line(capsys, args[:-1] + ["actor.max_tokens_per_micro_batch=512"])
    settings = MemorySettings(seq_len=512, micro_batch=1, sequence_parallel=False)
    assert f"training peak {predict_peak(hf, train_layout(hf, layout), settings) / GiB:.2f} GiB" in budget, budget
    assert "micro-batches of 1 x 512 tokens" in budget


"""The TRL side of benchmarks/e2e_vs_trl.py: GRPOTrainer with HF generate, in a process of its own.

    python -m benchmarks.e2e_trl --model DIR --prompts FILE --out JSON [--device cuda]

One optimizer step per generation batch (generation_batch_size = --completions = micro-batch x gradient
accumulation), completions forced to full length (min_new_tokens), beta=0 (no reference model), bf16 on
the GPU. Gradient checkpointing is off (TRL turns it on by default; at 0.5B on an H200 memory is no
concern, and megarl does not recompute either). Writes --out after every step: per-step wall time (CUDA
synchronised, from one optimizer step's end to the next's), with the time in HF generate and in the
reward; the rest of a step (TRL's log-probs, loss, backward, optimizer, logging) is 'update'.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path

from benchmarks.e2e_vs_trl import vowel_share


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help=".jsonl of {'prompt': text}")
    p.add_argument("--completions", type=int, default=64, help="completions per optimizer step")
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    report = {"steps": []}
    try:
        run(args, report, lambda: out.write_text(json.dumps(report, indent=1)))
    except BaseException as error:  # a timeout's SIGINT too: keep the steps done so far
        report["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        traceback.print_exc()
        out.write_text(json.dumps(report, indent=1))
        return 1
    return 0


def run(args, report: dict, save) -> None:
    import pyarrow
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device == "cuda"
    report["versions"] = {n: metadata.version(n) for n in ("trl", "transformers", "datasets", "accelerate", "torch")}

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    phases = {"generation": 0.0, "reward": 0.0}

    def vowel_share_reward(completions, **kwargs) -> list[float]:
        start = now()
        rewards = [vowel_share(c, "", {}) for c in completions]
        phases["reward"] += now() - start
        return rewards

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *a, **k):  # tokenising the prompts and HF generate
            start = now()
            try:
                return super()._generate(*a, **k)
            finally:
                phases["generation"] += now() - start

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.last, self.logs = None, {}

        def on_train_begin(self, *a, **k):
            self.last = now()

        def on_log(self, args_, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:  # logged just after the step it describes
                report["steps"][-1]["response_length"] = logs["completions/mean_length"]
                report["steps"][-1]["log"] = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                save()

        def on_step_end(self, args_, state, control, **k):
            t = now()
            seconds = t - self.last
            timed = dict(phases)
            timed["update"] = max(0.0, seconds - sum(timed.values()))
            report["steps"].append({"step": state.global_step, "seconds": seconds, "phases": timed,
                                    "response_length": float(args.completion_len)})
            phases.update(generation=0.0, reward=0.0)
            self.last = t
            print(f"[trl] step {state.global_step}: {seconds:.2f} s {timed}", flush=True)
            save()

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    # A fingerprint given, not hashed from the Arrow table: datasets' dill hashing of a table fails on Python 3.12.1
    # with pyarrow 25/26 ("Can't pickle <class 'MonthDayNano'>"), and the GPU machine's Python is a 3.12.
    dataset = Dataset(InMemoryTable(pyarrow.table({"prompt": [r["prompt"] for r in rows]})), fingerprint="e2e-prompts")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-e2e-"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.completions // args.micro_batch,
        num_generations=args.n_samples, max_completion_length=args.completion_len,
        generation_kwargs={"min_new_tokens": args.completion_len}, temperature=1.0, beta=0.0, num_iterations=1,
        learning_rate=1e-6, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32},
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=1, log_completions=False)
    report["config"] = {k: getattr(config, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
        "steps_per_generation", "num_generations", "max_completion_length", "beta", "num_iterations", "bf16",
        "gradient_checkpointing", "loss_type", "use_vllm")}
    trainer = TimedGRPOTrainer(model=args.model, reward_funcs=vowel_share_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    print(f"[trl] {sum(p.numel() for p in trainer.model.parameters()) / 1e9:.3f}B parameters, "
          f"{trainer.model.dtype}, config {report['config']}", flush=True)
    trainer.train()
    save()


if __name__ == "__main__":
    sys.exit(main())

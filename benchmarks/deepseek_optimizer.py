"""The optimizer on the CPU against on the GPU for a DeepSeek-V3-shaped policy in megarl's megatron engine (one GPU):
SFT steps on fixed batches with megatron's distributed optimizer, its state and update on the GPU
(--cpu-offload false) or in host memory (actor.optimizer_cpu_offload), one process per setting. Writes the losses,
the step time, the peak GPU memory (torch.cuda.max_memory_allocated) and the planner's prediction for the same
run (megarl.reshard.memory.predict_peak), so deepseek.sh compares the two settings.

    python benchmarks/deepseek_optimizer.py --model-dir DIR --cpu-offload true --out on.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from pathlib import Path

import torch


def batches(tokenizer, rows: int, steps: int, length: int, seed: int = 0) -> list:
    """The string-reversal task's teacher-forced batches ("abcd>" -> "dcba" + eos), the same in every process."""
    from megarl.data.dataset import sft_batch

    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        words = ["".join(rng.choice("abcdefghij") for _ in range(length)) for _ in range(rows)]
        out.append(sft_batch(tokenizer, [{"prompt": w + ">", "answer": w[::-1]} for w in words]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--cpu-offload", choices=("true", "false"), required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=24, help="characters per prompt")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the plumbing (the offload is a no-op)")
    args = parser.parse_args()
    offload = args.cpu_offload == "true"
    result = dict(cpu_offload=offload, steps=args.steps, rows=args.rows, micro_batch=args.micro_batch)
    try:
        from transformers import AutoTokenizer

        from megarl.config.sections import ActorConfig, AlgorithmConfig
        from megarl.engine.megatron_engine import MegatronEngine
        from megarl.parallel.state import init_parallel
        from megarl.rollout.sglang_server import free_port

        cuda = args.device == "cuda"
        init_parallel(0, 1, "127.0.0.1", free_port(), device=args.device)
        actor = ActorConfig()
        actor.use_distributed_optimizer, actor.optimizer_cpu_offload = True, offload
        actor.micro_batch_size, actor.optim.lr = args.micro_batch, args.lr
        engine = MegatronEngine(args.model_dir, actor, AlgorithmConfig(), args.device, seed=1, total_steps=args.steps)
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        data = batches(tokenizer, args.rows, args.steps, args.length)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses, seconds = [], []
        for batch in data:
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            losses.append(engine.train(batch, loss="sft", lr=args.lr)["loss"])
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)
        result |= dict(losses=losses, step_s=min(seconds), steps_s=seconds, seq_len=data[0]["tokens"].shape[1],
                       peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None)
        result |= predicted(args, offload, result["seq_len"])
    except Exception as error:
        result |= dict(error=repr(error), trace=traceback.format_exc()[-3000:])
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}))
    if "error" in result:
        print(result["trace"])
        raise SystemExit(1)


def predicted(args, offload: bool, seq_len: int) -> dict:
    """The planner's per-GPU peak for this run (TP = PP = DP = 1, no reference snapshot)."""
    from megarl.reshard.layout import TrainLayout
    from megarl.reshard.memory import MemorySettings, predict_peak

    hf = json.loads((Path(args.model_dir) / "config.json").read_text())
    settings = MemorySettings(seq_len=seq_len, micro_batch=args.micro_batch, micro_batches=args.rows // args.micro_batch,
                              distributed_optimizer=True, optimizer_offload=offload)
    return dict(predicted_gb=predict_peak(hf, TrainLayout(1, 1, 1, hf["num_hidden_layers"]), settings) / 1e9)


if __name__ == "__main__":
    main()

"""Forward + backward time and peak memory of megarl.engine.logprobs.vocab_parallel_logprobs against the plain
torch formula it replaced, on one device at TP=1.

Input: random bf16 logits [--tokens, --vocab] (default: a 16 x 640-token micro-batch at Qwen2.5's 151936
vocabulary) with requires_grad, random targets. Per mode, the loss is sum(w1 * log p) (+ sum(w2 * H)):
  logprobs        - log-probs only (KL / PPO without entropy);
  entropy_metric  - plus the entropy as a metric (entropy_coef = 0): no entropy gradient;
  entropy_grad    - plus an entropy bonus: the entropy's gradient too.
baseline = logits.float() -> log_softmax -> gather (and -(p * log p).sum for H) under autograd.
Time: median of --repeats (after one warm-up, which is also timed: on CUDA the chunked function compiles its
kernels there) of forward + backward, synchronised. Peak: the device's peak
allocation during one forward + backward above what was allocated before it (the logits and their gradient
buffer of the previous run are freed first). Each row also carries the largest difference from the baseline
of log p, H and the logits' gradient (bf16: the gradient's is a bf16 rounding).

On a GPU (one):   python benchmarks/logprobs_speed.py --out logprobs_speed.json
On a CPU (smoke): python benchmarks/logprobs_speed.py --tokens 64 --vocab 1000 --repeats 1 --out /tmp/lp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from megatron.core import parallel_state

from megarl.engine import logprobs as logprobs_module
from megarl.engine.logprobs import vocab_parallel_logprobs
from megarl.utils.provenance import source_commit

MODES = {"logprobs": (False, False), "entropy_metric": (True, False), "entropy_grad": (True, True)}


def baseline(logits, targets, with_entropy, entropy_grad):
    log_p = torch.log_softmax(logits.float(), -1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logprobs, None
    with torch.enable_grad() if entropy_grad else torch.no_grad():
        return logprobs, -(log_p.exp() * log_p).sum(-1)


def chunked(logits, targets, with_entropy, entropy_grad):
    return vocab_parallel_logprobs(logits, targets, logits.shape[-1], with_entropy, entropy_grad)


def step(fn, logits, targets, weights, with_entropy, entropy_grad):
    """One forward + backward; (log p, H, d loss / d logits)."""
    logits.grad = None
    logprobs, entropy = fn(logits, targets, with_entropy, entropy_grad)
    loss = (weights[0] * logprobs).sum()
    if entropy_grad:
        loss = loss + (weights[1] * entropy).sum()
    loss.backward()
    return logprobs.detach(), None if entropy is None else entropy.detach(), logits.grad


def measure(fn, logits, targets, weights, mode, repeats, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    step(fn, logits, targets, weights, *MODES[mode])  # warm-up (the chunked one compiles its kernels here)
    logits.grad = None
    sync()
    warmup = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    seconds = []
    for _ in range(repeats):
        logits.grad = None
        sync()
        start = time.perf_counter()
        out = step(fn, logits, targets, weights, *MODES[mode])
        sync()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    return {"ms": 1e3 * statistics.median(seconds), "warmup_s": warmup,
            "peak_gib": None if peak is None else peak / 2 ** 30}, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16 * 640)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--out", required=True, help="JSON results file")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    parallel_state.set_tensor_model_parallel_rank(0)  # TP=1 without a process group
    parallel_state.set_tensor_model_parallel_world_size(1)

    g = torch.Generator(device).manual_seed(0)
    logits = (4 * torch.randn(1, args.tokens, args.vocab, generator=g, device=device)).bfloat16().requires_grad_()
    targets = torch.randint(0, args.vocab, (1, args.tokens), generator=g, device=device)
    weights = torch.randn(2, 1, args.tokens, generator=g, device=device)

    rows = []
    for mode in MODES:
        row = {"mode": mode}
        for name, fn in (("baseline", baseline), ("chunked", chunked)):
            try:
                row[name], outputs = measure(fn, logits, targets, weights, mode, args.repeats, device)
                row[name + "_outputs"] = outputs
            except torch.OutOfMemoryError as e:
                row[name] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            logits.grad = None
        if "baseline_outputs" in row and "chunked_outputs" in row:
            ref, new = row.pop("baseline_outputs"), row.pop("chunked_outputs")
            row["max_abs_diff"] = {k: None if a is None else (a.float() - b.float()).abs().max().item()
                                   for k, a, b in zip(("logprobs", "entropy", "grad"), ref, new)}
        row.pop("baseline_outputs", None), row.pop("chunked_outputs", None)
        rows.append(row)
        Path(args.out).write_text(json.dumps(_report(args, device, rows), indent=2))

    print(f"| mode | baseline ms | chunked ms | speed-up | baseline peak GiB | chunked peak GiB | chunked warm-up s "
          f"| max |diff| "
          f"logp / H / grad |  ({args.tokens} x {args.vocab} bf16, {device.type}, "
          f"compiled kernels: {_report(args, device, rows)['compiled_kernels']})")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        b, c = r["baseline"], r["chunked"]
        ms = lambda x: f"{x['ms']:.1f}" if "ms" in x else x["error"][:40]
        gib = lambda x: f"{x['peak_gib']:.2f}" if x.get("peak_gib") is not None else "-"
        speed = f"{b['ms'] / c['ms']:.2f}x" if "ms" in b and "ms" in c else "-"
        diff = " / ".join("-" if v is None else f"{v:.2g}" for v in r.get("max_abs_diff", {}).values()) or "-"
        warmup = f"{c['warmup_s']:.1f}" if "warmup_s" in c else "-"
        print(f"| {r['mode']} | {ms(b)} | {ms(c)} | {speed} | {gib(b)} | {gib(c)} | {warmup} | {diff} |")


def _report(args, device, rows):
    compiled = all(k.active(device) for k in (logprobs_module._CHUNK_SUMS, logprobs_module._CHUNK_GRAD))
    return {"commit": source_commit(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "compiled_kernels": compiled,
            "tokens": args.tokens, "vocab": args.vocab, "dtype": "bfloat16", "repeats": args.repeats, "rows": rows}


if __name__ == "__main__":
    main()

"""Asynchronous GRPO: the synchronous loop against one_step_off and async on the same workload, colocated on one GPU
(`--placement colocated`, the default) or disaggregated over several (`--placement disaggregated`): the two suites.

    python -m benchmarks.async_grpo --model qwen2.5-0.5b --out-dir OUT     # one H200: every run, ~9 min
    python -m benchmarks.async_grpo --placement disaggregated --lengths fixed --runs disagg_sync,disagg_async_s1 \
        --out-dir OUT
    python -m benchmarks.async_grpo --smoke [--placement disaggregated] --out-dir OUT  # CPU: tiny, transformers
    python -m benchmarks.async_grpo --report OUT1/async_grpo.json ...      # one table from several calls' results

The workload of benchmarks/e2e_vs_trl.py: a random-initialised Qwen2 of the shape in configs/models/<--model>.json
with an offline tokenizer of exactly its vocabulary, prompts of exactly --prompt-len tokens, completions forced to
--completion-len tokens (rollout.ignore_eos), --n-samples per prompt, the cheap rule reward vowel_share, no KL, one
optimizer step per batch, colocated SGLang (one GPU). Runs (--runs), each `python -m megarl.train` in its own
process under a deadline (warm-up steps left out of the numbers):

  sync_offload    trainer.mode=sync, the offload cycle (Megatron's state in host memory during rollouts, SGLang's
                  memory released during training: trainer.offload_between_phases=always)
  sync_resident   trainer.mode=sync, both engines resident side by side (offload never)
  one_step_off    trainer.mode=one_step_off (the rollout of step t+1 beside the training of step t), resident
  async_s1        trainer.mode=async, async.max_staleness=1, partial rollouts resumed at each update, resident
  async_s4        the same with async.max_staleness=4
  async_s4_k0     async_s4 generating the step-batches the buffer admits together (up to 5) in one engine call
                  (async.batches_at_once=0)
An asynchronous run measures its steady state only: its first and last max_staleness + 1 steps are left out (the
buffer's first fill, made before any update; the steps after the rollout has made the run's last batch: run_margins).

Disaggregated (--placement disaggregated; --gpus, default 2): a random Qwen2.5-1.5B, 128-token prompts, 8 samples per prompt, 64
prompts per step, --lengths fixed (every completion 1024 tokens) or tail (natural lengths up to 4096 with a long tail: so
many of the random model's vocabulary are stop tokens that --tail-share (10%) of its near-uniform samples run to
4096 and the rest end before, geometrically: partial rollouts matter; long_tail_stops); runs named <run>_<lengths>:
  colocated_sync        trainer.mode=sync on all --gpus, a colocated SGLang server on each, the offload cycle
  disagg_sync           the trainer on --gpus minus --server-gpus GPUs, SGLang servers on --server-gpus of their
                        own (rollout.sglang_gpus: weights broadcast over NCCL), synchronous
  disagg_one_step_off   the same placement, trainer.mode=one_step_off
  disagg_async_s1/_s4   the same placement, trainer.mode=async at async.max_staleness 1 / 4, partial rollouts resumed
Their speed-ups are against disagg_sync of the same lengths, beside its bound.

Per run: step time and tokens/s/GPU over the measured steps' wall clock (every token of a step, prompt and
completion, over the GPUs and the time from the end of the last warm-up step to the end of the last measured step,
as NeMo-RL counts), the trainer's own perf/tokens_per_s_per_gpu beside it, the staleness histogram, the mean time
of each phase, and the GPU busy fraction (NVML's utilization.gpu, the share of time a kernel ran, sampled by
nvidia-smi every 100 ms over the measured steps). For the sync runs, the bound an overlap could reach:
(T_gen + T_train) / max(T_gen, T_train), T_gen = generate + reward, T_train = the rest of the step. Each run's
phase intervals go into the JSON; benchmarks/plot_timeline.py draws them. Writes OUT/async_grpo.json; prints a
table last. A run that no longer fits in --budget-s is skipped and says so: run it in a second call (--runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import (ROOT, add_run_arguments, add_workload_arguments, check_completions, end_sglang_servers,
                               environment, run_process, smoke_sizes, start_run)
from benchmarks.e2e_vs_trl import build_model, megarl_command, model_shape, write_prompts
from megarl.utils.tracking import run_metrics

ONE_STEP_OFF = {"trainer.mode": "one_step_off", "async.partial": "finish"}
ASYNC = {"trainer.mode": "async", "async.partial": "resume"}
RUNS = {  # run -> (placement, megarl.train overrides beside the workload's)
    "sync_offload": ("colocated", {"trainer.mode": "sync", "trainer.offload_between_phases": "always"}),
    "sync_resident": ("colocated", {"trainer.mode": "sync", "trainer.offload_between_phases": "never"}),
    "one_step_off": ("colocated", ONE_STEP_OFF),
    "async_s1": ("colocated", ASYNC | {"async.max_staleness": 1}),
    "async_s4": ("colocated", ASYNC | {"async.max_staleness": 4}),
    "async_s4_k0": ("colocated", ASYNC | {"async.max_staleness": 4, "async.batches_at_once": 0}),
    "colocated_sync": ("colocated", {"trainer.mode": "sync", "trainer.offload_between_phases": "auto"}),
    "disagg_sync": ("disaggregated", {"trainer.mode": "sync"}),
    "disagg_one_step_off": ("disaggregated", ONE_STEP_OFF),
    "disagg_async_s1": ("disaggregated", ASYNC | {"async.max_staleness": 1}),
    "disagg_async_s4": ("disaggregated", ASYNC | {"async.max_staleness": 4}),
}
# in order of need: a call that runs out of time skips the last ones (on one GPU the offload cycle is the slowest sync)
SUITES = {"colocated": ["sync_resident", "async_s1", "async_s4", "async_s4_k0", "one_step_off", "sync_offload"],
          "disaggregated": ["colocated_sync", "disagg_sync", "disagg_one_step_off", "disagg_async_s1", "disagg_async_s4"]}
ROLLOUT_PHASES = ("generate", "reward", "generate_baseline")  # the rollout side's lane; the rest are the trainer's
CONTAINERS = ("rollout",)  # phases made of others (the rollout thread's whole batch): left out of timelines


def run_margins(args, name: str) -> tuple[int, int]:
    """Steps of run `name` before and after the measured ones. Before: --warmup; for an asynchronous run at least its
    buffer's first fill (max_staleness + 1 batches generated before any update, the trainer waiting: measured, they
    would be trained as if their generation were free). After: the step whose metrics wait for the final evaluation;
    for an asynchronous run max_staleness + 1, because the rollout stops once the run's batches are all made, so its
    last steps train alone. Measured between the two, every step shares the GPU with a batch being generated: the
    steady state."""
    overrides = RUNS[name][1]
    if overrides["trainer.mode"] == "sync":
        return args.warmup, 1
    ahead = overrides.get("async.max_staleness", 1) + 1
    return max(args.warmup, ahead), ahead


def run_overrides(args, name: str, model_dir: Path, prompts: Path, val: Path, run_dir: Path, device: str) -> list[str]:
    """The megarl.train command of run `name`: e2e_vs_trl's workload overrides, the placement's, then the run's."""
    before, after = run_margins(args, name)
    workload = SimpleNamespace(**vars(args), megarl_warmup=before, megarl_steps=args.steps + after, offload="never")
    cmd = megarl_command(workload, model_dir, prompts, val, args.completions, run_dir, device)
    placement, overrides = RUNS[name]
    if placement == "colocated":
        cmd.append(f"actor.parallel.world_size={args.gpus}")
    else:  # servers on GPUs of their own (on the CPU, the transformers engine in its own actor stands in)
        cmd.append(f"actor.parallel.world_size={args.gpus - args.server_gpus}")
        if not args.smoke:
            cmd += [f"rollout.sglang_gpus={args.server_gpus}",
                    f"rollout.sglang_mem_fraction={args.server_mem_fraction}"]
    if args.lengths == "tail":  # the stop tokens end rows (build_model's long_tail_stops)
        cmd.append("rollout.ignore_eos=false")
    if args.micro_batch_tokens:
        cmd.append(f"actor.max_tokens_per_micro_batch={args.micro_batch_tokens}")
    return cmd + [f"{k}={v}" for k, v in overrides.items()] + args.overrides


def long_tail_stops(model_dir: Path, cap: int, share: float) -> int:
    """Make enough of the model's vocabulary stop tokens (its EOS ids, in config.json and generation_config.json) that
    a row sampled near-uniformly (a random model's) runs to `cap` tokens with probability `share`: each token stops it
    with p = 1 - share^(1/cap), so k = p x vocab ids, spread over the vocabulary. Returns k."""
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    k = max(1, round(vocab * (1 - share ** (1 / cap))))
    stops = [config["eos_token_id"]] + list(range(2, vocab, max(1, (vocab - 2) // k)))[:k - 1]
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model_dir / name).read_text())
        data["eos_token_id"] = stops
        (model_dir / name).write_text(json.dumps(data, indent=1))
    return k


# ---- watching a run: when each step ended, and the GPU's utilisation ------------------------------------------


@contextmanager
def watch(output_dir: Path, gpu: bool):
    """While the run goes: the wall-clock time at which each step's metrics line appeared in the metrics.jsonl of the
    run that starts in `output_dir` (its own under logs/, not one that was there before; polled every 0.1 s) and,
    on GPUs, nvidia-smi's utilization.gpu of each every 100 ms. Yields a dict filled with "step_end" {step: unix s} and
    "gpu" [(unix s, percent)]."""
    seen: dict = {"step_end": {}, "gpu": []}
    stop = threading.Event()

    earlier = set(output_dir.glob("logs/*"))

    def follow_metrics():
        offset = 0
        while not stop.wait(0.1):
            started = sorted(set(output_dir.glob("logs/*")) - earlier)
            metrics_file = started[-1] / "metrics.jsonl" if started else None
            if metrics_file is None or not metrics_file.exists():
                continue
            with metrics_file.open() as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            for line in complete.splitlines():
                row = json.loads(line)
                if "timing/step" in row:
                    seen["step_end"].setdefault(row["step"], time.time())

    smi = None
    if gpu:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # every GPU of the run: its samples are averaged
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,index,utilization.gpu",
                                "--format=csv,noheader,nounits", "-lms", "100", *(["-i", visible] if visible else [])],
                               stdout=subprocess.PIPE, text=True)

        def follow_gpu():
            for line in smi.stdout:
                sample = parse_smi(line)
                if sample is not None:
                    seen["gpu"].append(sample)
        threading.Thread(target=follow_gpu, daemon=True).start()
    follower = threading.Thread(target=follow_metrics, daemon=True)
    follower.start()
    try:
        yield seen
    finally:
        stop.set()
        follower.join()
        if smi is not None:
            smi.terminate()
            smi.wait()


def parse_smi(line: str) -> tuple[float, float] | None:
    """'2026/11/24 07:25:00.123, 0, 87' (nvidia-smi's local time, GPU, utilization) -> (unix seconds, percent);
    None if unreadable."""
    try:
        fields = [p.strip() for p in line.split(",")]
        stamp, percent = fields[0], fields[-1]
        whole, _, millis = stamp.partition(".")
        return time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float(f"0.{millis or 0}"), float(percent)
    except ValueError:
        return None


# ---- the numbers of one run -------------------------------------------------------------------------------


def step_rows(metrics_file: Path) -> list[dict]:
    if not metrics_file.exists():
        return []
    return [r for r in map(json.loads, metrics_file.read_text().splitlines()) if "timing/step" in r]


def phase_intervals(row: dict, end: float | None = None) -> list[tuple[str, float, float]]:
    """A step's phases as (name, start, end): the trainer's marks phase/<name>/start|end where it logs them (the
    asynchronous modes, seconds since the run's start); else (the synchronous loop) its timing/<name> durations laid
    end to end, back from the step's end (`end`, default the step's own length: the step then starts at 0)."""
    marks = sorted((row[k], k[6:-6], row[k[:-6] + "/end"]) for k in row
                   if k.startswith("phase/") and k.endswith("/start") and k[:-6] + "/end" in row)
    if marks:
        return [(name, start, stop) for start, name, stop in marks if name not in CONTAINERS]
    durations = [(name, v) for name, v in durations_of(row).items() if name not in CONTAINERS and v > 0]
    t = (row["timing/step"] if end is None else end) - sum(v for _, v in durations)
    intervals = []
    for name, seconds in durations:
        intervals.append((name, t, t + seconds))
        t += seconds
    return intervals


def durations_of(row: dict) -> dict[str, float]:
    """A step's timing/<name> seconds by name, in the order the trainer logged them (timing/step left out)."""
    return {k[7:]: v for k, v in row.items() if k.startswith("timing/") and k.count("/") == 1 and k != "timing/step"}


def side_seconds(row: dict) -> tuple[float, float]:
    """(T_gen, T_train) of a synchronous step: generation and reward, and the rest of the step."""
    gen = sum(v for name, v in durations_of(row).items() if name in ROLLOUT_PHASES)
    return gen, row["timing/step"] - gen


def summarize_run(rows: list[dict], step_end: dict, gpu: list, warmup: int, steps: int, completions: int,
                  prompt_len: int, gpus: int, synchronous: bool) -> dict:
    """The measured steps (`steps` after `warmup`) of a run: wall-clock throughput between the end of the last warm-up
    step and the end of the last measured step (step_end: unix seconds each step's metrics appeared), the trainer's
    own numbers, staleness, phases, with `gpu` samples the busy fraction over that window, and for a `synchronous`
    run the bound an overlap of its two sides could reach."""
    measured = rows[warmup:warmup + steps]
    out = {"steps": len(rows), "measured_steps": len(measured)}
    if not measured:
        return out
    response = statistics.mean(r.get("train/response_length", 0.0) for r in measured)
    tokens = completions * (prompt_len + response)
    out |= {"mean_step_s": round(statistics.mean(r["timing/step"] for r in measured), 3),
            "response_length": round(response, 1), "tokens_per_step": tokens}
    first = step_end.get(rows[warmup - 1]["step"]) if warmup else None
    last = step_end.get(measured[-1]["step"])
    if first is not None and last is not None and last > first:
        window = last - first
        out |= {"measured_s": round(window, 3), "wall_step_s": round(window / len(measured), 3),
                "tokens_per_s_per_gpu": round(tokens * len(measured) / window / gpus, 1)}
        busy = [p for t, p in gpu if first <= t <= last]
        if busy:
            out["gpu_busy"] = round(statistics.mean(busy) / 100, 3)
    reported = [r["perf/tokens_per_s_per_gpu"] for r in measured if "perf/tokens_per_s_per_gpu" in r]
    if reported:
        out["trainer_tokens_per_s_per_gpu"] = round(statistics.mean(reported), 1)
    histogram = {}
    for r in measured:
        for k, v in r.items():
            if k.startswith("async/staleness_") and k[16:].isdigit():
                histogram[int(k[16:])] = histogram.get(int(k[16:]), 0) + v
    if histogram:
        out["staleness_histogram"] = {str(k): histogram[k] for k in sorted(histogram)}
    at_once = [r["async/batches_at_once"] for r in measured if "async/batches_at_once" in r]
    if at_once:  # step-batches in the engine call each measured step's batch came from
        out["batches_per_call"] = round(statistics.mean(at_once), 2)
    phases = {}
    for r in measured:
        for name, seconds in durations_of(r).items():
            phases[name] = phases.get(name, 0.0) + seconds / len(measured)
    out["phase_s"] = {k: round(v, 4) for k, v in phases.items()}
    if synchronous:
        gen, train = (statistics.mean(s) for s in zip(*map(side_seconds, measured)))
        out |= {"t_gen_s": round(gen, 3), "t_train_s": round(train, 3),
                "overlap_bound": round((gen + train) / max(gen, train, 1e-9), 3)}
    out["timeline"] = timeline(measured, step_end)
    return out


def timeline(rows: list[dict], step_end: dict) -> list[dict]:
    """Every phase of `rows` as {"step", "phase", "lane", "start", "end"}, seconds from the first one's start. With
    the trainer's marks, their own clock; without (synchronous), each step laid back from when its metrics appeared."""
    marked = any(k.startswith("phase/") for k in rows[0])
    spans = []
    for r in rows:
        end = None if marked else step_end.get(r["step"])
        if not marked and end is None:
            continue
        for name, start, stop in phase_intervals(r, end):
            spans.append({"step": r["step"], "phase": name, "start": start, "end": stop,
                          "lane": "rollout" if name in ROLLOUT_PHASES else "trainer"})
    origin = min((s["start"] for s in spans), default=0.0)
    return [s | {"start": round(s["start"] - origin, 4), "end": round(s["end"] - origin, 4)} for s in spans]


# ---- the table ----------------------------------------------------------------------------------------------


def table(runs: dict) -> str:
    """One row per run. The speed-up is against the run's `baseline` (disaggregated: disagg_sync of the same lengths),
    else against the best synchronous run's tokens/s/GPU; the bound beside it is that baseline's (a synchronous run's:
    its own)."""
    sync = [r for r in runs.values() if r.get("synchronous") and r.get("tokens_per_s_per_gpu")]
    best = max(sync, key=lambda r: r["tokens_per_s_per_gpu"], default={})
    lines = ["| run | status | measured steps | step s | tokens/s/GPU | speed-up (baseline) | bound | trainer's "
             "tok/s/GPU | GPU busy | staleness (rows by k) | phases (mean s) |", "|" + " --- |" * 11]
    for name, r in runs.items():
        base = runs.get(r.get("baseline"), best)
        tps, base_tps = r.get("tokens_per_s_per_gpu"), base.get("tokens_per_s_per_gpu")
        bound = (r if r.get("synchronous") else base).get("overlap_bound")
        f = lambda k, fmt="{:.3g}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
        staleness = " ".join(f"{k}:{v:g}" for k, v in r.get("staleness_histogram", {}).items()) or "-"
        staleness += f" (batches/call {r['batches_per_call']:g})" if "batches_per_call" in r else ""
        phases = ", ".join(f"{k} {v:.3g}" for k, v in r.get("phase_s", {}).items())
        speedup = f"{tps / base_tps:.2f}x ({base.get('name')})" if tps and base_tps else "-"
        lines.append(f"| {name} | {r.get('status', '-')} | {r.get('measured_steps', 0)} | {f('wall_step_s')} "
                     f"| {f('tokens_per_s_per_gpu', '{:,.0f}')} | {speedup} "
                     f"| {'-' if bound is None else f'{bound:.2f}x'} "
                     f"| {f('trainer_tokens_per_s_per_gpu', '{:,.0f}')} | {f('gpu_busy', '{:.0%}')} | {staleness} "
                     f"| {phases} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p, smoke="CPU: tiny model and lengths, the transformers engine", budget_s=520,
                      out_dir_required=False)
    p.add_argument("--report", nargs="+", metavar="JSON", help="print one table from these results files and exit")
    p.add_argument("--placement", choices=sorted(SUITES), default="colocated", help="the suite of runs and its "
                   "workload: colocated (one GPU, the trainer and SGLang on it) or disaggregated (several GPUs, the "
                   "trainer and SGLang servers on GPUs of their own, against colocated_sync on all of them)")
    add_workload_arguments(p)
    p.add_argument("--runs", default="", help=f"comma-separated, of {', '.join(RUNS)} (default: the placement's "
                                              "suite)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of every run (tokens/s/GPU divides by them)")
    p.add_argument("--server-gpus", type=int, default=0, help="disaggregated runs: the SGLang servers' GPUs "
                                                              "(default half of --gpus)")
    p.add_argument("--lengths", choices=("fixed", "tail"), default="fixed", help="fixed: every completion "
                   "--completion-len tokens (ignore_eos); tail: natural lengths up to --completion-len, "
                   "--tail-share of them at that cap (long_tail_stops)")
    p.add_argument("--tail-share", type=float, default=0.1)
    p.add_argument("--completions", type=int, default=256, help="completions per step")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="actor.max_tokens_per_micro_batch (0: megarl's "
                   "automatic width, --micro-batch rows of the longest sequence; the disaggregated tail: the fixed "
                   "workload's width, 16 x 1152, since 16 rows of 4224 tokens run a 1.5B update out of memory)")
    p.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE", help="megarl overrides for every run, "
                   "after the run's own (e.g. async.partial=restart)")
    p.add_argument("--tag", default="", help="appended to every run's name in the results (runs with --overrides)")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the numbers")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--server-mem-fraction", type=float, default=0.85, help="disaggregated runs' servers")
    p.add_argument("--run-cap-s", type=float, default=210, help="most seconds one run may take (the last: what is "
                   "left); the first SGLang start on a fresh machine JIT-compiles for ~60 s more than the others")
    given = sys.argv[1:] if argv is None else argv
    chosen, _ = p.parse_known_args(given)
    if chosen.placement == "disaggregated":  # its workload, unless given explicitly
        tail = chosen.lengths == "tail"
        p.set_defaults(model="qwen2.5-1.5b", gpus=2, completion_len=4096 if tail else 1024, completions=512,
                       run_cap_s=400, micro_batch_tokens=16 * (128 + 1024) if tail else 0)
    smoke_sizes(p, given, n_samples=2, completions=8, warmup=1, steps=2, run_cap_s=300, budget_s=2400,
                micro_batch_tokens=0)
    args = p.parse_args(argv)
    if not args.report and not args.out_dir:
        p.error("--out-dir is required (or --report)")
    args.runs = [r for r in args.runs.split(",") if r] or SUITES[args.placement]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    args.server_gpus = args.server_gpus or args.gpus // 2
    if any(RUNS[r][0] == "disaggregated" for r in args.runs) and not 0 < args.server_gpus < args.gpus:
        p.error(f"disaggregated runs need --gpus >= 2 with --server-gpus below it "
                f"(got {args.gpus}, {args.server_gpus})")
    check_completions(args, args.completions)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        runs = {}
        for path in args.report:
            runs |= json.loads(Path(path).read_text())["runs"]
        print(table(runs))
        return 0
    deadline, out, device, work, model_dir = start_run(args)
    prompts, val = work / "prompts.jsonl", work / "val.jsonl"
    shape = model_shape(args.model, args.smoke)
    words = build_model(model_dir, shape, device)
    stops = long_tail_stops(model_dir, args.completion_len, args.tail_share) if args.lengths == "tail" else 1
    write_prompts(prompts, words, 4096, args.prompt_len, seed=1)
    write_prompts(val, words, args.val_size, args.prompt_len, seed=2)
    report = {"benchmark": "async_grpo", "placement": args.placement, **environment(device), "device": device,
              "setup": {"model": "smoke" if args.smoke else args.model, "shape": shape, "prompt_len": args.prompt_len,
                        "completion_len": args.completion_len, "lengths": args.lengths, "stop_tokens": stops,
                        "n_samples": args.n_samples, "completions_per_step": args.completions,
                        "micro_batch": args.micro_batch, "warmup": args.warmup, "gpus": args.gpus,
                        "server_gpus": args.server_gpus, "sglang_mem_fraction": args.sglang_mem_fraction,
                        "server_mem_fraction": args.server_mem_fraction, "reward": "vowel_share",
                        "cuda_mps": "CUDA_MPS_PIPE_DIRECTORY" in os.environ},
              "runs": {}}
    result_file = out / "async_grpo.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", NCCL_NVLS_ENABLE="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    suffix = (f"_{args.lengths}" if args.placement == "disaggregated" else "") + args.tag
    tag = (lambda name: name + suffix)  # a run's name in the results
    for i, name in enumerate(args.runs):
        left = deadline - time.monotonic()
        cap = left if i == len(args.runs) - 1 else min(left, args.run_cap_s)
        if cap < 60:
            report["runs"][tag(name)] = {"status": f"skipped: {left:.0f} s left of --budget-s (run it alone: "
                                                   f"--runs {name})"}
            continue
        run_dir = work / name
        print(f"== {tag(name)}: up to {cap:.0f} s", flush=True)
        with watch(run_dir, gpu=device == "cuda") as seen:
            record = run_process(run_overrides(args, name, model_dir, prompts, val, run_dir, device),
                                 out / f"{tag(name)}.log", cap, env, leftovers=str(model_dir),
                                 server_logs=run_dir)
        metrics = run_metrics(run_dir)
        if metrics.exists():
            (out / f"{tag(name)}_metrics.jsonl").write_text(metrics.read_text())
        placement, overrides = RUNS[name]
        synchronous = overrides["trainer.mode"] == "sync"
        record |= {"name": tag(name), "placement": placement, "overrides": overrides | dict(
                       o.split("=", 1) for o in args.overrides), "synchronous": synchronous,
                   "baseline": tag("disagg_sync") if args.placement == "disaggregated" else None} | summarize_run(
            step_rows(metrics), seen["step_end"], seen["gpu"], run_margins(args, name)[0], args.steps, args.completions,
            args.prompt_len, args.gpus, synchronous)
        report["runs"][tag(name)] = record
        result_file.write_text(json.dumps(report, indent=1))
        print(f"   {record['status']} in {record['wall_s']} s: {record.get('measured_steps', 0)} measured steps, "
              f"tokens/s/GPU {record.get('tokens_per_s_per_gpu')}", flush=True)
        if record["status"] != "ok":
            print("   | " + "\n   | ".join((out / record["log"]).read_text(errors="replace").splitlines()[-15:]))
    end_sglang_servers(str(model_dir))
    result_file.write_text(json.dumps(report, indent=1))
    print(f"\nresults: {result_file}\n{report['gpu']} x {args.gpus}; {report['setup']['model']}, prompt "
          f"{args.prompt_len} + completion {args.completion_len} tokens ({args.lengths}), {args.completions} "
          f"completions/step ({args.n_samples} per prompt)\n")
    print(table(report["runs"]))
    return 0 if all(r.get("status") == "ok" for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

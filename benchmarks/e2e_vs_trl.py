"""End-to-end GRPO speed: megarl against TRL's GRPOTrainer, one after the other on the same GPU.

    python -m benchmarks.e2e_vs_trl --out-dir OUT            # one H200: TRL, then megarl at 64 and 256
    python -m benchmarks.e2e_vs_trl --smoke --out-dir OUT    # CPU: tiny shapes, megarl with the HF engine

The same model, prompts, lengths and reward for both:
- a random-initialised Qwen2 of the shape in configs/models/<--model>.json (Qwen2.5-0.5B: hidden 896,
  24 layers, 14 heads / 2 KV heads, FFN 4864, vocab 151,936, tied embeddings), bf16 on the GPU;
- an offline byte-level BPE tokenizer of exactly the model's vocabulary (word_tokenizer below), so every
  sampled id decodes and the lm_head and softmax cost what they cost with the real vocabulary;
- prompts of exactly --prompt-len tokens, completions forced to --completion-len tokens (TRL:
  min_new_tokens; megarl: rollout.ignore_eos), --n-samples per prompt, a cheap rule reward
  (vowel_share), no reference model (TRL beta=0, megarl kl_coef=0), one optimizer step per batch.

Each run is its own process under a deadline (--budget-s for everything): TRL (benchmarks/e2e_trl.py:
HF generate) with --trl-completions per step, then `python -m megarl.train` (Megatron + SGLang colocated)
once per --megarl-completions. Warm-up steps are left out of the numbers. A run that fails or runs out of
time keeps the steps it finished; its log is in --out-dir. Writes OUT/e2e_vs_trl.json (commit, GPU,
versions, per-step wall times, tokens/s, per-phase times) and prints a table last.
benchmarks/plot_e2e.py draws the plot from that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (ROOT, add_run_arguments, add_workload_arguments, check_completions, environment,
                               run_process, smoke_sizes, start_run)
from megarl.utils.tracking import run_metrics

VOWELS = frozenset("aeiou")
PAD, EOS = "<pad>", "<eos>"
SMOKE_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True, "rope_theta": 10000.0,
               "rms_norm_eps": 1e-6, "max_position_embeddings": 256}


def vowel_share(response: str, answer: str, sample: dict) -> float:
    """The cheap rule reward: the share of the response's characters that are vowels (a megarl reward;
    e2e_trl.py wraps it for TRL). Random responses differ in it, so GRPO groups carry a signal."""
    return sum(c in VOWELS for c in response) / max(1, len(response))


# ---- model, tokenizer and prompts, built offline -------------------------------------------------------


def word_tokenizer(vocab_size: int, special_tokens: tuple[str, ...] = ()):
    """A byte-level BPE (Qwen2Tokenizer) of exactly `vocab_size` tokens with no training data: <pad>, <eos>, the
    `special_tokens` (ids 2.., inside the vocabulary: it does not grow), the 256 byte symbols, then ' a'..' z',
    ' aa'..' zz', ' aaa'.. (a space and lowercase letters, one letter more per level, each token the merge of its
    prefix and its last letter) until the vocabulary is full. A prompt of k words from the last level is exactly
    k tokens. Returns (tokenizer, the last level's words)."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {PAD: 0, EOS: 1} | {token: 2 + i for i, token in enumerate(special_tokens)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    if vocab_size <= len(vocab) + 26:
        raise ValueError(f"vocab_size={vocab_size}: needs more than {len(vocab) + 26} tokens")
    merges, level = [], ["\u0120"]  # byte-level's space
    while len(vocab) < vocab_size:
        longer = []
        for prefix in level:
            for letter in "abcdefghijklmnopqrstuvwxyz":
                if len(vocab) == vocab_size:
                    break
                vocab[prefix + letter] = len(vocab)
                merges.append((prefix, letter))
                longer.append(prefix + letter)
        level = longer
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token=EOS, pad_token=PAD,
                               model_max_length=32768)
    # special: matched whole in text (not split into bytes) and dropped by decode(skip_special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens], special_tokens=True)
    return tokenizer, [w[1:] for w in level]


def model_shape(name: str, smoke: bool) -> dict:
    if smoke:
        return dict(SMOKE_MODEL)
    from megarl.reshard.plan import load_model_config

    return load_model_config(name)


def build_model(out_dir: Path, shape: dict, device: str, seed: int = 0, special_tokens: tuple[str, ...] = (),
                chat_template: str | None = None) -> list[str]:
    """A random-initialised Qwen2ForCausalLM of `shape` (an HF config dict) with word_tokenizer's vocabulary (and
    `special_tokens`, `chat_template`), saved in bf16 (fp32 on CPU) as an ordinary HF directory. Returns the
    tokenizer's prompt words."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer, words = word_tokenizer(shape["vocab_size"], special_tokens)
    tokenizer.chat_template = chat_template
    config = Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=shape.get("max_position_embeddings", 32768), rms_norm_eps=shape["rms_norm_eps"],
        rope_parameters={"rope_theta": shape.get("rope_theta", 10000.0), "rope_type": "default"},
        tie_word_embeddings=shape.get("tie_word_embeddings", True), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, architectures=["Qwen2ForCausalLM"])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 0.5B parameters on the GPU takes a second, not a minute
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    return words


def write_prompts(path: Path, words: list[str], count: int, length: int, seed: int) -> None:
    """`count` prompts of exactly `length` tokens (random words of the tokenizer's last level), as the
    {"prompt", "answer"} rows megarl's prompt files take (the reward ignores the answer)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            text = "".join(" " + rng.choice(words) for _ in range(length))
            f.write(json.dumps({"prompt": text, "answer": ""}) + "\n")


# ---- the two sides -------------------------------------------------------------------------------------


def trl_command(args, model_dir: Path, prompts: Path, out_json: Path, device: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.e2e_trl", "--model", str(model_dir), "--prompts", str(prompts),
            "--completions", str(args.trl_completions), "--n-samples", str(args.n_samples),
            "--completion-len", str(args.completion_len), "--micro-batch", str(args.micro_batch),
            "--warmup", str(args.trl_warmup), "--steps", str(args.trl_steps), "--device", device,
            "--out", str(out_json)]


def megarl_command(args, model_dir: Path, prompts: Path, val: Path, completions: int, run_dir: Path,
                   device: str) -> list[str]:
    engine = "hf" if args.smoke else "sglang"
    overrides = {
        "model.path": model_dir, "trainer.device": device, "trainer.output_dir": run_dir,
        "actor.parallel.world_size": 1, "actor.parallel.tp": 1, "rollout.engine": engine,
        "rollout.sglang_mem_fraction": args.sglang_mem_fraction, "rollout.n_samples": args.n_samples,
        "rollout.max_new_tokens": args.completion_len, "rollout.ignore_eos": "true", "rollout.temperature": 1.0,
        "rollout.eval_n_samples": 1, "data.task": prompts, "data.val_task": val, "data.val_size": args.val_size,
        "data.prompts_per_step": completions // args.n_samples, "reward.name": "benchmarks.e2e_vs_trl:vowel_share",
        "algorithm.advantage": "grpo", "algorithm.kl_coef": 0.0, "actor.micro_batch_size": args.micro_batch,
        "actor.mini_batch_size": 0, "actor.ppo_epochs": 1, "actor.optim.lr": 1e-6, "sft.steps": 0,
        # the measured workload: prompts as they are (TRL's side takes them so) and TRL's AdamW without weight decay
        "data.chat_template": "false", "actor.optim.weight_decay": 0.0,
        "trainer.steps": args.megarl_warmup + args.megarl_steps, "trainer.eval_every": 1_000_000,
        "trainer.verify_weight_sync_every": 0, "trainer.loggers": "console,jsonl", "trainer.resume": "none",
        "trainer.cpus_per_rank": 1, "trainer.offload_between_phases": args.offload}
    extra = getattr(args, "megarl_overrides", [])  # last: they override the benchmark's own
    return [sys.executable, "-m", "megarl.train", *(f"{k}={v}" for k, v in overrides.items()), *extra]


def summarize(steps: list[dict], warmup: int, completions: int, prompt_len: int) -> dict:
    """Per-step rows {'seconds', 'response_length', 'phases': {name: s}} -> the measured steps' numbers.
    Tokens per step = completions x (prompt + mean response length), prompt and completion tokens alike."""
    measured = steps[warmup:]
    out = {"warmup_step_s": [round(s["seconds"], 3) for s in steps[:warmup]],
           "step_s": [round(s["seconds"], 3) for s in measured], "measured_steps": len(measured)}
    if not measured:
        return out
    step = statistics.mean(s["seconds"] for s in measured)
    response = statistics.mean(s["response_length"] for s in measured)
    tokens = completions * (prompt_len + response)
    names = dict.fromkeys(n for s in measured for n in s["phases"])
    phases = {n: statistics.mean(s["phases"].get(n, 0.0) for s in measured) for n in names}
    return out | {"mean_step_s": round(step, 3), "response_length": round(response, 1), "tokens_per_step": tokens,
                  "tokens_per_s": round(tokens / step, 1),
                  "generated_tokens_per_s": round(completions * response / step, 1),
                  "phase_s": {n: round(v, 4) for n, v in phases.items()},
                  "phase_tokens_per_s": {n: round(tokens / v, 1) for n, v in phases.items() if v > 0}}


MEGARL_PHASES = {  # timing/<name> of megarl's trainer -> phase; the rest of timing/step is 'other'
    "generate": "generation", "reward": "reward", "onload": "memory to training", "old_logprobs": "log-probs",
    "train": "update", "sync": "weight sync", "offload": "memory to rollout"}


def megarl_steps(metrics_file: Path) -> list[dict]:
    """The RL steps in a megarl run's metrics.jsonl as summarize() rows; phases are the trainer's timing/*
    (any new timing names, e.g. memory release/resume, come through under their own names)."""
    steps = []
    if not metrics_file.exists():
        return steps
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        if "timing/step" not in row:
            continue
        phases = {MEGARL_PHASES.get(k[7:], k[7:]): v for k, v in row.items()
                  if k.startswith("timing/") and k != "timing/step"}
        phases["other"] = max(0.0, row["timing/step"] - sum(phases.values()))
        steps.append({"step": row.get("step"), "seconds": row["timing/step"],
                      "response_length": row["train/response_length"], "phases": phases})
    return steps


def table(report: dict) -> str:
    trl = report["runs"].get("trl", {}).get("tokens_per_s")
    lines = ["| run | status | completions/step | measured steps | mean step s | tokens/s | vs TRL | phases (mean s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in report["runs"].items():
        tps = r.get("tokens_per_s")
        ratio = f"{tps / trl:.1f}x" if tps and trl else ""
        phases = ", ".join(f"{k} {v:.3g}" for k, v in r.get("phase_s", {}).items())
        lines.append(f"| {name} | {r['status']} | {r['completions']} | {r.get('measured_steps', 0)} "
                     f"| {r.get('mean_step_s', '')} | {tps or ''} | {ratio} | {phases} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p, smoke="CPU: tiny model and lengths, megarl with the HF engine", budget_s=510)
    add_workload_arguments(p)
    p.add_argument("--runs", default="trl,megarl", help="which sides, comma-separated: trl, megarl")
    p.add_argument("--trl-completions", type=int, default=64, help="TRL: completions per step")
    p.add_argument("--megarl-completions", default="64,256", help="megarl: completions per step, one run each")
    p.add_argument("--trl-warmup", type=int, default=1)
    p.add_argument("--trl-steps", type=int, default=2)
    p.add_argument("--megarl-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="megarl config overrides after the benchmark's (e.g. trainer.profile_update=4)")
    p.add_argument("--megarl-warmup", type=int, default=2)
    p.add_argument("--megarl-steps", type=int, default=4)
    p.add_argument("--offload", default="never", choices=("auto", "always", "never"),
                   help="megarl's trainer.offload_between_phases. never: a 0.5B model, its optimizer and its SGLang "
                        "server fit the GPU together (TRL too keeps everything resident); auto moves the training "
                        "state to host memory during rollouts, for models that do not fit beside the server")
    p.add_argument("--trl-cap-s", type=float, default=170, help="most seconds TRL may take")
    p.add_argument("--megarl-cap-s", type=float, default=230, help="most seconds a megarl run may take, "
                                                                    "but the last one gets what is left")
    smoke_sizes(p, argv, trl_completions=8, megarl_completions="8,16", trl_warmup=1, trl_steps=1, megarl_warmup=1,
                megarl_steps=1)
    args = p.parse_args(argv)
    args.megarl_completions = [int(c) for c in str(args.megarl_completions).split(",") if c]
    check_completions(args, args.trl_completions, *args.megarl_completions)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline, out, device, work, model_dir = start_run(args)
    t0 = time.monotonic()
    shape = model_shape(args.model, args.smoke)
    words = build_model(model_dir, shape, device)
    prompts, val = work / "prompts.jsonl", work / "val.jsonl"
    write_prompts(prompts, words, 1024, args.prompt_len, seed=1)
    write_prompts(val, words, args.val_size, args.prompt_len, seed=2)
    params = sum(_parameter_counts(model_dir).values())
    report = {"benchmark": "e2e_vs_trl", **environment(device), "device": device,
              "setup": {"model": "smoke" if args.smoke else args.model, "shape": shape, "parameters": params,
                        "prompt_len": args.prompt_len, "completion_len": args.completion_len,
                        "n_samples": args.n_samples, "micro_batch": args.micro_batch, "reward": "vowel_share",
                        "reference_model": False, "updates_per_batch": 1, "megarl_offload": args.offload,
                        "trl_warmup": args.trl_warmup,
                        "megarl_warmup": args.megarl_warmup, "model_build_s": round(time.monotonic() - t0, 1)},
              "runs": {}}
    result_file = out / "e2e_vs_trl.json"

    def save():
        result_file.write_text(json.dumps(report, indent=1))

    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", NCCL_NVLS_ENABLE="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    sides = args.runs.split(",")
    plan = ([("trl", args.trl_completions)] if "trl" in sides else []) + \
           ([(f"megarl_{c}", c) for c in args.megarl_completions] if "megarl" in sides else [])
    for i, (name, completions) in enumerate(plan):
        left = deadline - time.monotonic()
        last = i == len(plan) - 1
        cap = left if last else min(left, args.trl_cap_s if name == "trl" else args.megarl_cap_s)
        record = {"completions": completions}
        if cap < 20:
            report["runs"][name] = record | {"status": "skipped (no time left)"}
            save()
            continue
        print(f"== {name}: {completions} completions/step, up to {cap:.0f} s", flush=True)
        if name == "trl":
            raw = out / "trl_raw.json"
            record |= run_process(trl_command(args, model_dir, prompts, raw, device), out / "trl.log", cap, env)
            data = json.loads(raw.read_text()) if raw.exists() else {}
            steps, warmup = data.get("steps", []), args.trl_warmup
            record |= {k: data[k] for k in ("versions", "config", "error") if k in data}
        else:
            run_dir = work / name
            record |= run_process(megarl_command(args, model_dir, prompts, val, completions, run_dir, device),
                                  out / f"{name}.log", cap, env, leftovers=str(model_dir), server_logs=run_dir)
            steps, warmup = megarl_steps(run_metrics(run_dir)), args.megarl_warmup
            if run_metrics(run_dir).exists():
                (out / f"{name}_metrics.jsonl").write_text(run_metrics(run_dir).read_text())
            for server_log in sorted(run_dir.glob("sglang_*.log")):  # the SGLang server's own log, its end
                tail = server_log.read_text(errors="replace").splitlines()[-80:]
                (out / f"{name}_{server_log.name}").write_text("\n".join(tail) + "\n")
        if device == "cuda":  # what the run left on the GPU (the next run needs it free)
            record["gpu_memory_used_after"] = _gpu_memory_used()
        record |= summarize(steps, warmup, completions, args.prompt_len)
        report["runs"][name] = record
        save()
        print(f"   {record['status']} in {record['wall_s']} s: step s {record.get('step_s')}, "
              f"tokens/s {record.get('tokens_per_s')}", flush=True)
        if record["status"] != "ok":  # the end of its log, where the reason is
            print("   | " + "\n   | ".join((out / record["log"]).read_text(errors="replace").splitlines()[-15:]))
    trl = report["runs"].get("trl", {}).get("tokens_per_s")
    report["speedup_vs_trl"] = {n: round(r["tokens_per_s"] / trl, 2) for n, r in report["runs"].items()
                                if n != "trl" and trl and r.get("tokens_per_s")}
    save()
    print(f"\nresults: {result_file}\n{report['gpu']}; {report['setup']['model']} ({params / 1e9:.2f}B params), "
          f"prompt {args.prompt_len} + completion {args.completion_len} tokens, {args.n_samples} per prompt\n")
    print(table(report))
    return 0 if all(r["status"] == "ok" for r in report["runs"].values()) else 1


def _gpu_memory_used() -> str:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"], capture_output=True,
                         text=True)
    return smi.stdout.strip() if smi.returncode == 0 else "unknown"


def _parameter_counts(model_dir: Path) -> dict[str, int]:
    """Parameters per tensor in the saved safetensors (a tied lm_head is saved once)."""
    import math

    from safetensors import safe_open

    counts = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            counts |= {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}
    return counts


if __name__ == "__main__":
    sys.exit(main())

"""The GSM8K GRPO recipe (scripts/recipes/grpo_gsm8k_qwen2.5_0.5b.sh) where the GSM8K files cannot be had: synthetic
GSM8K-format data and a random Qwen2.5-0.5B-shaped model, built offline, to measure what weight-sync verification
costs the recipe (the recipe with verification on and off: scripts/gpu/verify.sh PARTS=gsm8k).

    python -m benchmarks.gsm8k_recipe prepare --out DIR [--smoke]   # DIR/model, DIR/raw/{train,test}.jsonl
    python -m benchmarks.gsm8k_recipe table RUN_DIR...              # per run: step and verification seconds

The data is synthetic because the GPU machines have no network; a step's cost depends on shapes (batch, prompt
and response lengths), not on the text. Rows are GSM8K's {"question", "answer"}, the answer's last line
"#### N", as many as the public release has (7,473 train, 1,319 test), and they go through the recipe's own
conversion (scripts/preprocess/gsm8k.py, which appends the "####" instruction). Their lengths are GSM8K's in
tokens: with Qwen2.5-Instruct's tokenizer and chat template a GSM8K prompt is ~100-110 tokens (a ~46-word question
of ~60 tokens, the instruction, the template's default system message). The offline tokenizer below spends ~2.5
tokens per word of ordinary English (byte-level pieces) on the fixed text, so the template leaves the system
message out and a question is 25-50 of the tokenizer's one-token words, ~15% of them numbers (~1.6 tokens a word):
~115 tokens a rendered prompt (`prepare` prints the counts).

The model: the Qwen2.5-0.5B shape (configs/models/qwen2.5-0.5b.json) with random weights, built by
benchmarks/e2e_vs_trl.py's build_model (its offline tokenizer of the full vocabulary) with Qwen's chat tokens and
Qwen's ChatML layout (the recipe sets data.chat_template=true). A random policy rarely samples its end-of-sequence
token, so nearly every response runs to rollout.max_new_tokens (the table shows the mean response length).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from benchmarks.e2e_vs_trl import build_model, model_shape
from benchmarks.e2e_vs_verl import QWEN_CHAT_TOKENS
from megarl.utils.tracking import run_metrics

# Qwen2.5-Instruct's layout of a conversation without tools (without its default system message: see above)
QWEN_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GSM8K_ROWS = {"train": 7473, "test": 1319}  # the public release's
SMOKE_ROWS = {"train": 8, "test": 4}
SYNTHETIC_NOTE = ("synthetic GSM8K-format data (no GSM8K files on the GPU machines, no network; a step's cost "
                  "depends on shapes, not on the text) and a random Qwen2.5-0.5B-shaped model")


def gsm8k_row(rng: random.Random, words: list[str]) -> dict:
    """One {"question", "answer"} row in GSM8K's format: a question of 25-50 words in sentences, ~15% of them
    numbers, ending with '?'; a solution of calculator lines (GSM8K's <<a+b=c>>) whose last line is '#### N'."""
    count, numbers, tokens = rng.randint(25, 50), [], []
    for i in range(count):
        if rng.random() < 0.15:
            numbers.append(rng.randint(2, 500))
            tokens.append(str(numbers[-1]))
        else:
            tokens.append(rng.choice(words))
        if i < count - 1 and rng.random() < 0.1:
            tokens[-1] += "."
    numbers = numbers or [rng.randint(2, 500)]
    total, lines = numbers[0], []
    for n in numbers[1:4]:
        lines.append(f"{total} + {n} = <<{total}+{n}={total + n}>>{total + n}")
        total += n
    question = " ".join(tokens).capitalize() + "?"
    return {"question": question, "answer": "\n".join(lines + [f"#### {total}"])}


def prepare(out: Path, smoke: bool, device: str) -> dict:
    """out/model (the random model and its tokenizer) and out/raw/{train,test}.jsonl (GSM8K-format rows)."""
    shape = model_shape("qwen2.5-0.5b", smoke)
    if smoke:  # the tiny vocabulary spells the prompts in bytes: ~200 tokens, past SMOKE_MODEL's 256 positions
        shape["max_position_embeddings"] = 1024
    words = build_model(out / "model", shape, device, special_tokens=QWEN_CHAT_TOKENS, chat_template=QWEN_CHATML)
    rng = random.Random(0)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    rows = SMOKE_ROWS if smoke else GSM8K_ROWS
    for split, count in rows.items():
        with (out / "raw" / f"{split}.jsonl").open("w") as f:
            for _ in range(count):
                f.write(json.dumps(gsm8k_row(rng, words)) + "\n")
    return {"model": str(out / "model"), "shape": shape, "rows": rows, "prompt_tokens": prompt_tokens(out)}


def prompt_tokens(out: Path, count: int = 200) -> dict:
    """Token counts of the first `count` training prompts as the recipe feeds them to the model: converted by
    scripts/preprocess/gsm8k.py's record function, rendered with the chat template (GSM8K with Qwen2.5-Instruct:
    ~100-110 tokens)."""
    from transformers import AutoTokenizer

    from megarl.data.dataset import render_prompt
    from megarl.data.preprocess import gsm8k_record

    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    rows = [json.loads(line) for line in (out / "raw" / "train.jsonl").read_text().splitlines()[:count]]
    lengths = [len(tokenizer(render_prompt(tokenizer, gsm8k_record(r)["prompt"], chat_template=True),
                             add_special_tokens=False)["input_ids"]) for r in rows]
    return {"min": min(lengths), "mean": round(statistics.mean(lengths), 1), "max": max(lengths)}


def step_rows(run_dir: Path) -> list[dict]:
    """The RL steps' rows of a run's metrics.jsonl (evaluation-only rows have no timing/step)."""
    path = run_metrics(run_dir)
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "timing/step" in r]


def summarize(rows: list[dict], warmup: int) -> dict | None:
    """Medians over the steps after `warmup`: the step, and the verification inside it: the sync's on-path part
    (sync/verify_s: the senders' checksums and the bookkeeping) plus the deferred collection of the previous verified
    sync's checksums from SGLang's TP workers and their comparison (sync/verify_deferred_s), both within timing/step."""
    measured = [r for r in rows if r["step"] > warmup]
    if not measured:
        return None
    verify = [r.get("sync/verify_s", 0.0) + r.get("sync/verify_deferred_s", 0.0) for r in measured]
    step = statistics.median(r["timing/step"] for r in measured)
    return {"steps": [r["step"] for r in measured], "step_s": step, "verify_s": statistics.median(verify),
            "verified": sum(r.get("sync/verified", 0.0) for r in measured),
            "response_tokens": statistics.mean(r["train/response_length"] for r in measured)}


def table(run_dirs: list[Path], warmup: int = 1) -> str:
    lines = [f"GSM8K GRPO recipe: {SYNTHETIC_NOTE}; the first {warmup} step(s) of each run left out",
             "| run | steps measured | median step s | verification s | share of step | verified syncs | "
             "mean response tokens |", "|" + " --- |" * 7]
    medians = {}
    for run in run_dirs:
        s = summarize(step_rows(run), warmup)
        if s is None:
            lines.append(f"| {run.name} | no step after the warm-up in {run_metrics(run)} | | | | | |")
            continue
        medians[run.name] = s["step_s"]
        lines.append(f"| {run.name} | {s['steps']} | {s['step_s']:.2f} | {s['verify_s']:.3f} | "
                     f"{s['verify_s'] / s['step_s']:.2%} | {s['verified']:.0f} | {s['response_tokens']:.0f} |")
    if len(medians) == 2:
        (a, sa), (b, sb) = medians.items()
        lines.append(f"median step {a} - {b}: {sa - sb:+.2f} s ({(sa - sb) / sb:+.2%} of {b}'s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the model directory and the GSM8K-format files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few rows (CPU)")
    t = sub.add_parser("table", help="the step and verification seconds of runs' metrics.jsonl")
    t.add_argument("runs", type=Path, nargs="+", help="the runs' trainer.output_dir")
    t.add_argument("--warmup", type=int, default=1, help="first steps left out")
    args = parser.parse_args(argv)
    if args.command == "table":
        print(table(args.runs, args.warmup))
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    print(f"gsm8k_recipe: {SYNTHETIC_NOTE}", flush=True)
    print(json.dumps(prepare(args.out, args.smoke, device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

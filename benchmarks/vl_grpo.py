"""Vision-language GRPO on the GPU: a random Qwen2.5-VL-3B-shaped policy with Megatron and a real SGLang server
(scripts/gpu/vl.sh runs the steps below around `python -m megarl.train`, the trainer itself).

  build   the model directory: Qwen2.5-VL-3B's shapes (36 layers, hidden 2048, the 32-block vision tower, whose MLP
          width 3420 SGLang pads to 3424) with megarl's offline tokenizer and its vision tokens, so a vocabulary of
          ~100 tokens (~3.4B parameters, bf16), images resized to 112x112 pixels (64 patches, 16 placeholder tokens);
          and the shapes task's prompt files (megarl/data/shapes.py). --shape tiny: the tests' tiny model (CPU smoke).
  images  one prompt with image A, image B and image A again, greedy, each its own request (SGLang's prefix cache
          flushed before each): SGLang's tokens and log-probs must repeat for A and change for B (the image reaches
          the model through megarl's processed inputs; a random model's greedy tokens may not change, its
          distribution does). --engine hf: the transformers engine (CPU smoke).
  table   the trainer's metrics (reward, mean |SGLang log-prob - Megatron log-prob| on the sampled tokens, every
          weight sync verified by checksums computed inside SGLang's TP worker: every parameter it holds, the vision
          tower's included, against the sender's) and the image check; exits non-zero when a check failed.

    python benchmarks/vl_grpo.py build RUN --shape 3b --device cuda
    python benchmarks/vl_grpo.py images RUN --engine sglang --out RUN/images.json
    python benchmarks/vl_grpo.py table RUN
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megarl.rollout.tools import Tool, ToolResult
from megarl.rollout.tools.parsers import ToolCall
from megarl.utils.tracking import run_metrics

# Qwen2.5-VL-3B-Instruct's published shapes (the vocabulary and token ids are the offline tokenizer's)
SHAPE_3B = dict(
    text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
    tie_word_embeddings=True)
PIXELS_3B = 112 * 112  # every image resized to 112x112: 8x8 patches of 14 pixels, 4x4 merged tokens


# The agent check (vl.sh AGENT=1): every model turn calls a tool that answers with an image, so each conversation is
# two turns around it: the tool's image reaches the next turn's request (SGLang's processor_output with the prompt's
# images and the tool's) and Megatron's rows.
class ShowSquare(Tool):
    """A tool that answers with an image: a red square on grey (16 x 16 pixels, resized by the image processor)."""
    name = "show_square"

    def run(self, **unused):
        from PIL import Image

        image = Image.new("RGB", (16, 16), (128, 128, 128))
        image.paste((255, 0, 0), (4, 4, 12, 12))
        return ToolResult("a square:", [image])


def show_square_every_turn(text: str) -> list[ToolCall]:
    """A tool-call parser under which every model turn calls show_square (a random policy writes no tool calls)."""
    return [ToolCall("show_square")]


def build(run: Path, shape: str, device: str) -> dict:
    from megarl.data.shapes import write_shapes_splits
    from megarl.models.tiny_vl import build_tiny_vl_model

    start = time.perf_counter()
    if shape == "3b":
        build_tiny_vl_model(run / "model", shape=SHAPE_3B, dtype=torch.bfloat16, device=device,
                            min_pixels=PIXELS_3B, max_pixels=PIXELS_3B)
    else:
        build_tiny_vl_model(run / "model")
    write_shapes_splits(run / "shapes", train_rows=256, val_rows=32, seed=0)
    return {"shape": shape, "build_s": time.perf_counter() - start}


def check_images(run: Path, engine_name: str, device: str) -> dict:
    """Greedy tokens of one prompt with images A, B, A (shapes val rows 0 and 2: different counts of red squares)."""
    from transformers import AutoTokenizer

    from megarl.data.images import ImagePrompts, image_examples
    from megarl.rollout.base import ImageInputs, SamplingParams

    model, val = run / "model", run / "shapes" / "val"
    rows = [json.loads(line) for line in (val / "prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    a, b = image_examples([rows[0], rows[2]], tokenizer, ImagePrompts(model, tokenizer), val, chat_template=True)
    assert a["prompt_ids"] == b["prompt_ids"], "the two rows' prompts must differ in their images only"
    if engine_name == "sglang":
        from megarl.rollout.sglang import SGLangRolloutEngine

        engine = SGLangRolloutEngine(str(model), colocated=False, mem_fraction=0.3, cuda_graph=False,
                                     memory_saver=False, log_dir=str(run))
        before = lambda: engine.servers[0].post("/flush_cache")  # noqa: E731  (greedy on near-tied random logits)
    else:
        from megarl.rollout.hf import HFRolloutEngine

        engine, before = HFRolloutEngine(str(model), device=device), (lambda: None)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    out = {}
    start = time.perf_counter()
    try:
        for name, ex in (("a", a), ("b", b), ("a_again", a)):
            before()
            (gen,) = engine.generate([ex["prompt_ids"]], params, [ImageInputs(ex["pixel_values"], ex["image_grid_thw"])])
            out[name] = {"tokens": gen.token_ids, "logprobs": gen.logprobs}
    finally:
        engine.shutdown()
    gaps = [abs(x - y) for x, y in zip(out["a"]["logprobs"], out["b"]["logprobs"])]
    return {"engine": engine_name, "prompt_tokens": len(a["prompt_ids"]), "seconds": time.perf_counter() - start,
            "same_image_same_output": out["a"] == out["a_again"],
            "other_image_other_tokens": out["a"]["tokens"] != out["b"]["tokens"],
            "other_image_max_logprob_change": max(gaps), "other_image_changes_output": out["a"] != out["b"], **out}


def mm_backend(run: Path) -> str:
    """The vision tower's attention backend, as the servers' logs name it."""
    for log in sorted(run.rglob("sglang_*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "as multimodal attention backend" in line:
                return line.split("Using ", 1)[-1].split(" as multimodal", 1)[0]
    return "-"


def table(run: Path) -> int:
    metrics = run_metrics(run / "train")
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "timing/step" in r] \
        if metrics.exists() else []
    images = json.loads((run / "images.json").read_text()) if (run / "images.json").exists() else {}
    build_info = json.loads((run / "build.json").read_text()) if (run / "build.json").exists() else {}
    fmt = lambda r, k, p=3: f"{r[k]:.{p}f}" if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
    print(f"\nshape {build_info.get('shape', '?')}, vision attention backend in SGLang: {mm_backend(run)}")
    print("| step | reward | mean abs(rollout - Megatron log-prob) | sync verified (checksums where held) | sync s | "
          "verify s | step s | model turns (AGENT=1) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in steps:
        print(f"| {r.get('step')} | {fmt(r, 'train/reward')} | {fmt(r, 'rollout/logprob_abs_diff', 4)} | "
              f"{r.get('sync/verified', '-')} | {fmt(r, 'sync/seconds')} | {fmt(r, 'sync/verify_s')} | "
              f"{fmt(r, 'timing/step')} | {fmt(r, 'agent/turns', 2)} |")
    if images:
        print(f"images ({images['engine']}, greedy, {len(images['a']['tokens'])} tokens): image A twice -> the same "
              f"tokens and log-probs: {images['same_image_same_output']}; image B -> other tokens: "
              f"{images['other_image_other_tokens']}, log-probs changed by up to "
              f"{images['other_image_max_logprob_change']:.4g}")
    synced = [r for r in steps if "sync/verified" in r]
    failed = [name for name, ok in (
        ("no GRPO step finished", bool(steps)),
        ("a sync was not verified", all(r["sync/verified"] == 1.0 for r in synced) and bool(synced)),
        ("the image check did not run", bool(images)),
        ("the same image gave another output", images.get("same_image_same_output", False)),
        ("another image gave the same output", images.get("other_image_changes_output", False))) if not ok]
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["build", "images", "table"])
    parser.add_argument("run", type=Path, help="the run's directory (model, prompt files, JSON, the trainer's output)")
    parser.add_argument("--shape", choices=["3b", "tiny"], default="3b")
    parser.add_argument("--engine", choices=["sglang", "hf"], default="sglang")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.run.mkdir(parents=True, exist_ok=True)
    if args.step == "table":
        sys.exit(table(args.run))
    result = build(args.run, args.shape, args.device) if args.step == "build" else \
        check_images(args.run, args.engine, args.device)
    (args.run / f"{args.step}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("a", "b", "a_again")}))


if __name__ == "__main__":
    main()

"""Qwen2.5-VL on megarl's Megatron engine against transformers, on one device (the model side of
vision-language RL).

A random Qwen2.5-VL (--shape 3b: Qwen2.5-VL-3B's shapes, built and saved by transformers; tiny: the tests' model)
reads --rows image+text rows (random text ids, one or two images of random pixel values per row, 28x28 patches:
392x392 pixels, 196 placeholder tokens each). Reported: transformers' log-probs (one row at a time) against
MegatronEngine's (packed micro-batches of at most --max-tokens tokens) on the real tokens after the first, mean and
max |difference|; the engine's forward time and one SFT train step's time (median of --repeats after a warm-up),
tokens/s of the step, peak device memory. Prints a one-row table last.

On a GPU (one):   PYTHONPATH=. python benchmarks/vl_megatron.py --shape 3b --out vl.json
On a CPU (smoke): PYTHONPATH=. python benchmarks/vl_megatron.py --shape tiny --device cpu --out /tmp/vl.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

# Qwen2.5-VL-3B-Instruct's config.json shapes (published), random weights
SHAPE_3B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True, architectures=["Qwen2_5_VLForConditionalGeneration"])


def build_model(shape: str, out: Path, device: torch.device) -> dict:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if shape == "tiny":
        from tests.models.hf_qwen2_vl import save_random_qwen2_vl

        save_random_qwen2_vl(out)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**SHAPE_3B)).to(torch.bfloat16)
        model.save_pretrained(out)
        del model
    return json.loads((out / "config.json").read_text())


def make_rows(hf: dict, rows: int, text_tokens: int, grid: int) -> list[dict]:
    vision = hf["vision_config"]
    merge, patch_dim = vision["spatial_merge_size"], 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    g = torch.Generator().manual_seed(0)
    image_ids = [hf["vision_start_token_id"]] + [hf["image_token_id"]] * (grid * grid // merge ** 2) + \
        [hf["vision_end_token_id"]]
    out = []
    for i in range(rows):
        images = 1 + i % 2
        ids = []
        for _ in range(images):
            ids += torch.randint(10, 90, (text_tokens // (2 * images),), generator=g).tolist() + image_ids
        ids += torch.randint(10, 90, (text_tokens // 2,), generator=g).tolist()
        out.append(dict(ids=ids, pixel_values=torch.randn(images * grid * grid, patch_dim, generator=g),
                        image_grid_thw=torch.tensor([[1, grid, grid]] * images)))
    return out


@torch.no_grad()
def hf_logprobs(model_dir: Path, rows: list[dict], dtype, device) -> list[torch.Tensor]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    image_token = model.config.image_token_id
    out = []
    for r in rows:
        ids = torch.tensor([r["ids"]], device=device)
        logits = model(input_ids=ids, pixel_values=r["pixel_values"].to(device, dtype),
                       image_grid_thw=r["image_grid_thw"].to(device), mm_token_type_ids=(ids == image_token).int()
                       ).logits[0].float()
        out.append(torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0].cpu())
    del model
    return out


def timed(fn, repeats: int, device) -> tuple[float, object]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["3b", "tiny"], default="3b")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--grid", type=int, default=28, help="patches per image side")
    parser.add_argument("--max-tokens", type=int, default=4096, help="actor.max_tokens_per_micro_batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
    from megarl.engine import MegatronEngine
    from megarl.parallel.state import destroy_parallel, init_parallel
    from tests.models.test_qwen2_vl import vl_batch

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        start = time.perf_counter()
        hf = build_model(args.shape, model_dir, device)
        build_s = time.perf_counter() - start
        grid = args.grid if args.shape == "3b" else 4
        rows = make_rows(hf, args.rows, args.text_tokens if args.shape == "3b" else 12, grid)
        reference = hf_logprobs(model_dir, rows, dtype, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_parallel(0, 1, "127.0.0.1", port, device=device.type)
        try:
            actor = ActorConfig(precision="bf16" if dtype == torch.bfloat16 else "fp32", micro_batch_size=1,
                                max_tokens_per_micro_batch=args.max_tokens, optim=OptimConfig(lr=1e-6))
            engine = MegatronEngine(str(model_dir), actor, AlgorithmConfig(), device.type, 1, 10)
            batch = vl_batch(rows)
            forward_s, out = timed(lambda: engine.compute_logprobs(batch)["logprobs"], args.repeats, device)
            gaps = torch.cat([(out[i, 1:len(ref) + 1].cpu() - ref).abs() for i, ref in enumerate(reference)])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            train_s, _ = timed(lambda: engine.train(batch, loss="sft"), args.repeats, device)
            peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
        finally:
            destroy_parallel()
    tokens = sum(len(r["ids"]) for r in rows)
    report = dict(shape=args.shape, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  dtype=str(dtype), rows=args.rows, tokens=tokens, images=sum(len(r["image_grid_thw"]) for r in rows),
                  build_s=build_s, logprob_gap_mean=gaps.mean().item(), logprob_gap_max=gaps.max().item(),
                  forward_s=forward_s, train_step_s=train_s, train_tokens_per_s=tokens / train_s, peak_gib=peak)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("| shape | device | dtype | rows / tokens / images | |logp gap| mean / max | forward s | train step s "
          "| train tokens/s | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.shape} | {report['device']} | {dtype} | {args.rows} / {tokens} / {report['images']} "
          f"| {report['logprob_gap_mean']:.3g} / {report['logprob_gap_max']:.3g} | {forward_s:.3f} | {train_s:.3f} "
          f"| {tokens / train_s:.0f} | {'-' if peak is None else f'{peak:.1f}'} |")


if __name__ == "__main__":
    main()

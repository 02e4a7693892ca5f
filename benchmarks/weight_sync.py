"""Weight sync into a real SGLang server, colocated on one GPU (CUDA IPC), and rollout throughput.

For each model size: a megatron GPTModel (random bf16 weights, TP=1) and an SGLang server started
with --load-format dummy on the same GPU. One sync is timed from the end of a train step (CUDA
synchronised) to SGLang ready to generate, split into
  resume   - SGLang takes back its weights memory (it was released, as during training),
  convert  - megarl.parallel.reshard yields HF-named tensors from the megatron shards (at TP=1
             there is nothing to gather; q/k/v and gate/up are cut out of the fused weights),
  transfer - CUDA IPC handles posted to /update_weights_from_tensor, per bucket,
  ready    - flush the prefix cache and resume the KV cache;
effective GB/s = bytes synced / the total. Then (--throughput) megarl's rollout path
(SGLangRolloutEngine.generate: HTTP, n samples, log-probs) against SGLang's own Engine.generate on the
same requests. Prints a table and writes JSON (--out).

    python benchmarks/weight_sync.py --models qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from megarl.plan import load_model_config


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def build_policy(hf: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megarl.models import get_family

    family = get_family(hf)
    config = family.transformer_config(hf, 1, 1, torch.bfloat16, use_cpu_initialization=False)
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), pre_process=True, post_process=True,
                   **family.gpt_model_kwargs(hf, 1)).cuda().to(torch.bfloat16)
    return gpt, family.weight_maps(hf, 1)


def bench_sync(name: str, bucket_mb: int, log_dir: str) -> dict:
    from megarl.parallel.inventory import hf_inventory
    from megarl.parallel.reshard import Resharder, TrainLayout, held_rows
    from megarl.rollout.sglang import SGLangServer
    from megarl.rollout.transports import cuda_ipc

    hf = load_model_config(name)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    (model_dir / "config.json").write_text(json.dumps(hf))
    server = SGLangServer(str(model_dir), load_format="dummy", mem_fraction=0.35, log_dir=log_dir).start()
    try:
        gpt, maps = build_policy(hf)
        specs = hf_inventory(hf)
        train = TrainLayout(1, 1, 1, hf["num_hidden_layers"])
        resharder = Resharder(specs, train, held_rows(gpt, maps, specs, train, 0), 0)
        rows = []
        for trial in range(3):  # the first is a warm-up (IPC and loader paths)
            server.post("/release_memory_occupation", {})
            t0 = _sync()
            server.post("/resume_memory_occupation", {"tags": ["weights"]})
            t1 = _sync()
            convert = transfer = 0.0
            nbytes = 0
            buckets = resharder.buckets(1, "full", bucket_mb << 20, torch.bfloat16)
            while True:
                a = _sync()
                bucket = next(buckets, None)
                b = _sync()
                if bucket is None:
                    break
                cuda_ipc.send_bucket(server, bucket, flush_cache=False)
                c = _sync()
                convert, transfer = convert + b - a, transfer + c - b
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                del bucket
            t2 = _sync()
            server.post("/flush_cache")
            server.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
            t3 = _sync()
            rows.append(dict(model=name, params=sum(s.numel for s in specs), bytes=nbytes, total_s=t3 - t0,
                             resume_s=t1 - t0, convert_s=convert, transfer_s=transfer, ready_s=t3 - t2,
                             gb_per_s=nbytes / (t3 - t0) / 1e9, transfer_gb_per_s=nbytes / transfer / 1e9))
        del gpt, resharder
        torch.cuda.empty_cache()
        return min(rows[1:], key=lambda r: r["total_s"])
    finally:
        server.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)


def bench_throughput(name: str, prompts: int, prompt_len: int, new_tokens: int, n: int, log_dir: str) -> dict:
    """The same requests through megarl's engine (its server) and through sglang.Engine in-process."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.sglang import SGLangRolloutEngine

    hf = load_model_config(name)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-tp-"))
    (model_dir / "config.json").write_text(json.dumps(hf))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(100, 10000, (prompts, prompt_len), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_new_tokens=new_tokens, n=n, temperature=1.0)
    result = dict(model=name, prompts=prompts, n=n, new_tokens=new_tokens)
    # ignore_eos on every path: the dummy model's EOS would otherwise end rows at random
    engine = SGLangRolloutEngine(str(model_dir), colocated=False, load_format="dummy", mem_fraction=0.7,
                                 log_dir=log_dir, sampling_overrides={"ignore_eos": True})
    try:
        ignore = {"ignore_eos": True}
        rates = []
        for batch in batches:  # the first is a warm-up
            rows = [p for p in batch for _ in range(n)]
            start = time.perf_counter()
            outs = engine.servers[0].post("/generate", {"input_ids": rows, "return_logprob": True,
                                                        "sampling_params": {"max_new_tokens": new_tokens,
                                                                            "temperature": 1.0, **ignore}})
            # megarl's path: the engine's own generate (parsing, n samples) on the same server
            rates.append(sum(len(o["meta_info"]["output_token_logprobs"]) for o in outs)
                         / (time.perf_counter() - start))
        megarl_rates = []
        for batch in batches:
            start = time.perf_counter()
            gens = engine.generate(batch, params)
            megarl_rates.append(sum(len(x.token_ids) for x in gens) / (time.perf_counter() - start))
        result |= dict(http_tok_s=max(rates[1:]), megarl_tok_s=max(megarl_rates[1:]))
    finally:
        engine.shutdown()
    import sglang

    llm = sglang.Engine(model_path=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                        attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.7)
    try:
        rates = []
        for batch in batches:
            rows = [p for p in batch for _ in range(n)]
            start = time.perf_counter()
            outs = llm.generate(input_ids=rows, return_logprob=True,
                                sampling_params={"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
            rates.append(sum(len(o["meta_info"]["output_token_logprobs"]) for o in outs)
                         / (time.perf_counter() - start))
        result["sglang_engine_tok_s"] = max(rates[1:])
    finally:
        llm.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--log-dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    from megarl.parallel.state import destroy_parallel, init_parallel
    init_parallel(0, 1, "127.0.0.1", 29555, device="cuda")
    sync = [bench_sync(m, args.bucket_mb, args.log_dir) for m in args.models]
    destroy_parallel()
    print("| model | params | GB | total s | resume | convert | transfer | ready | effective GB/s | transfer GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sync:
        print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['bytes'] / 1e9:.2f} | {r['total_s']:.3f} | {r['resume_s']:.3f} "
              f"| {r['convert_s']:.3f} | {r['transfer_s']:.3f} | {r['ready_s']:.3f} | {r['gb_per_s']:.1f} "
              f"| {r['transfer_gb_per_s']:.1f} |")
    throughput = None
    if args.throughput:
        throughput = bench_throughput(args.models[0], 256, 128, 512, 1, args.log_dir)
        print(f"rollout tok/s on {throughput['model']}: megarl {throughput['megarl_tok_s']:.0f}, raw HTTP "
              f"{throughput['http_tok_s']:.0f}, sglang.Engine {throughput['sglang_engine_tok_s']:.0f}")
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = git.stdout.strip() if git.returncode == 0 else os.environ.get("MEGARL_COMMIT", "unknown")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(commit=commit, gpu=torch.cuda.get_device_name(), sync=sync,
                                                  throughput=throughput), indent=2))


if __name__ == "__main__":
    main()

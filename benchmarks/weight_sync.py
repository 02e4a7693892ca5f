"""Weight sync into real SGLang servers, and rollout throughput against SGLang's own Engine.

Parts (one process each; each writes its JSON to --out, so one failing part loses nothing else):
  sync        colocated CUDA IPC. Per model (random Qwen2-shape, SGLang --load-format dummy, one server
              per model reused for every measurement), per payload format of transports/cuda_ipc.py
              (tensors, flattened_bucket, persistent): a warm-up sync, then the best of --trials timed
              syncs from the end of a train step (CUDA synchronised) to SGLang ready to generate:
                resume   - SGLang takes back its weights memory (released during training),
                gather   - training-TP all-gathers (0 here: the policy is at TP=1),
                convert  - megarl.parallel.reshard yields HF-named tensors (q/k/v, gate/up cut out of
                           the fused megatron weights), time the main thread spends producing buckets,
                pack     - the format's copy into a flat buffer and the IPC handles' serialisation,
                transfer - time the main thread waits on /update_weights_from_tensor (bucket k is posted
                           in a thread while bucket k+1 is converted and packed),
                ready    - flush the prefix cache, resume the KV cache;
              effective GB/s = bytes / total. --server-tp 2 puts one TP=2 server on GPUs 0-1 (trainer on 0).
              With --verify, after each format's timed syncs SGLang checks itself bit for bit (its weights
              checker: what the format delivered vs its own loader reading the exported tensors).
  throughput  megarl's rollout path (SGLangRolloutEngine.generate: HTTP, n samples, log-probs) against
              sglang.Engine.generate in-process on the same requests (same n, log-probs, ignore_eos).
  nccl        disaggregated: trainer on GPU 0, a TP=1 server on GPU 1, weights broadcast over NCCL
              (init_weights_update_group / update_weights_from_distributed), flattened and per-tensor,
              verified bit for bit as above.

    python benchmarks/weight_sync.py sync --models qwen2.5-0.5b qwen2.5-7b --out sync.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megarl.plan import load_model_config
from megarl.utils.provenance import source_commit


def _now() -> float:
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


def model_dir_for(name: str) -> Path:
    directory = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    (directory / "config.json").write_text(json.dumps(load_model_config(name)))
    return directory


class Policy:
    """A random bf16 megatron GPTModel at TP=1 and its resharder (full HF tensors per bucket)."""

    def __init__(self, name: str):
        from megarl.parallel.inventory import hf_inventory
        from megarl.parallel.reshard import Resharder, TrainLayout, held_rows

        hf = load_model_config(name)
        self.gpt, maps = build_policy(hf)
        self.specs = hf_inventory(hf)
        train = TrainLayout(1, 1, 1, hf["num_hidden_layers"])
        self.resharder = Resharder(self.specs, train, held_rows(self.gpt, maps, self.specs, train, 0), 0)

    def buckets(self, bucket_mb: int):
        return self.resharder.buckets(1, "full", bucket_mb << 20, torch.bfloat16)

    def received(self, bucket_mb: int) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu() for b in self.buckets(bucket_mb) for n, t in b}


def timed_sync(endpoints, send_bucket, buckets) -> dict:
    """One sync, colocated: resume weights, stream the buckets, flush and resume the KV cache."""
    from megarl.rollout.transports.cuda_ipc import send_overlapped

    for e in endpoints:
        e.post("/release_memory_occupation", {})  # as during training
    t0 = _now()
    for e in endpoints:
        e.post("/resume_memory_occupation", {"tags": ["weights"]})
    t1 = _now()
    stats = send_overlapped(buckets, send_bucket)
    t2 = _now()
    for e in endpoints:
        e.post("/flush_cache")
        e.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    t3 = _now()
    return dict(bytes=stats["bytes"], buckets=stats["buckets"], total_s=t3 - t0, resume_s=t1 - t0, gather_s=0.0,
                convert_s=stats["produce_s"], pack_s=stats["prepare_s"], transfer_s=stats["wait_s"],
                ready_s=t3 - t2, gb_per_s=stats["bytes"] / (t3 - t0) / 1e9)


def part_sync(args) -> list[dict]:
    from megarl.rollout.sglang import sglang_server, verify_inside_sglang
    from megarl.rollout.transports.cuda_ipc import CudaIpcSender

    rows = []
    for name in args.models:
        model_dir = model_dir_for(name)
        server = sglang_server(str(model_dir), tp=args.server_tp, load_format="dummy", mem_fraction=args.mem_fraction,
                               log_dir=args.log_dir, startup_timeout=args.startup_timeout, request_timeout=120)
        policy = None
        try:
            t = time.perf_counter()
            server.start()
            startup = time.perf_counter() - t
            policy = Policy(name)
            endpoints = [server.endpoint()]
            for fmt in args.formats:
                try:
                    sender = CudaIpcSender(endpoints, fmt)
                    trials = [timed_sync(endpoints, sender.send, policy.buckets(args.bucket_mb))
                              for _ in range(args.trials + 1)][1:]  # the first warms up IPC and loader paths
                    best = min(trials, key=lambda r: r["total_s"])
                    row = dict(model=name, params=sum(s.numel for s in policy.specs), format=fmt,
                               server_tp=args.server_tp, bucket_mb=args.bucket_mb, startup_s=startup,
                               trials_total_s=[r["total_s"] for r in trials], **best)
                    if args.verify and name == args.models[0]:
                        t = time.perf_counter()
                        verify_inside_sglang(endpoints, policy.received(args.bucket_mb), str(model_dir),
                                             Path(tempfile.mkdtemp(prefix="verify-")))
                        row |= dict(verified=True, verify_s=time.perf_counter() - t)
                    del sender
                except Exception as error:  # one format failing must not lose the others
                    row = dict(model=name, format=fmt, server_tp=args.server_tp, error=repr(error),
                               trace=traceback.format_exc()[-3000:], server_log=server.log_tail(20))
                print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "server_log")}), flush=True)
                rows.append(row)
                _write(args.out, rows)
        except Exception as error:
            rows.append(dict(model=name, server_tp=args.server_tp, error=repr(error), trace=traceback.format_exc()[-3000:],
                             server_log=server.log_tail(40)))
            print(rows[-1], flush=True)
            _write(args.out, rows)
        finally:
            server.shutdown()
            del policy
            torch.cuda.empty_cache()
            shutil.rmtree(model_dir, ignore_errors=True)
    return rows


def part_throughput(args) -> dict:
    """The same requests through megarl's engine and through sglang.Engine in-process."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.sglang import SGLangRolloutEngine

    name = args.models[0]
    model_dir = model_dir_for(name)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(100, 10000, (args.prompts, args.prompt_len), generator=g).tolist() for _ in range(2)]
    n, new = args.n, args.new_tokens
    sampling = {"max_new_tokens": new, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    result = dict(model=name, prompts=args.prompts, prompt_len=args.prompt_len, n=n, new_tokens=new)
    # ignore_eos on every path: the dummy model's EOS would otherwise end rows at random
    # megarl's HTTP path with the server as sglang.Engine runs (no memory saver: megarl_tok_s), and as the
    # colocated trainer launches it (memory saver on: megarl_memory_saver_tok_s), to split the gap
    for key, memory_saver in (("megarl_tok_s", False), ("megarl_memory_saver_tok_s", True)):
        engine = SGLangRolloutEngine(str(model_dir), colocated=False, load_format="dummy", mem_fraction=0.7,
                                     memory_saver=memory_saver, log_dir=args.log_dir,
                                     sampling_overrides={"ignore_eos": True}, startup_timeout=args.startup_timeout)
        try:
            rates = []
            for batch in batches:  # the first is a warm-up
                start = time.perf_counter()
                gens = engine.generate(batch, SamplingParams(max_new_tokens=new, n=n, temperature=1.0))
                rates.append(sum(len(x.token_ids) for x in gens) / (time.perf_counter() - start))
            result[key] = rates[-1]
            _write(args.out, result)
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
            outs = llm.generate(input_ids=rows, return_logprob=True, sampling_params=sampling)
            rates.append(sum(len(o["meta_info"]["output_token_logprobs"]) for o in outs)
                         / (time.perf_counter() - start))
        result["sglang_engine_tok_s"] = rates[-1]
        result["ratio"] = result["megarl_tok_s"] / result["sglang_engine_tok_s"]
        result["ratio_memory_saver"] = result["megarl_memory_saver_tok_s"] / result["sglang_engine_tok_s"]
    finally:
        llm.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)
    _write(args.out, result)
    return result


def part_nccl(args) -> list[dict]:
    from megarl.rollout.sglang import free_port, sglang_server, verify_inside_sglang
    from megarl.rollout.transports.nccl_broadcast import NcclBroadcast

    rows = []
    name = args.models[0]
    model_dir = model_dir_for(name)
    server = sglang_server(str(model_dir), gpu=1, load_format="dummy", mem_fraction=0.5, memory_saver=False,
                           log_dir=args.log_dir, startup_timeout=args.startup_timeout, request_timeout=120)
    try:
        server.start()
        policy = Policy(name)
        for flattened in (True, False):
            try:
                transport = NcclBroadcast(server.endpoint(), "127.0.0.1", free_port(),
                                          group_name=f"megarl_{int(flattened)}", flattened=flattened)
                trials = []
                for _ in range(args.trials + 1):
                    t0 = _now()
                    nbytes = 0
                    for bucket in policy.buckets(args.bucket_mb):
                        transport.send_bucket(bucket, flush_cache=False)
                        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    server.post("/flush_cache")
                    t1 = _now()
                    trials.append(dict(bytes=nbytes, total_s=t1 - t0, gb_per_s=nbytes / (t1 - t0) / 1e9))
                row = dict(model=name, transport="nccl", flattened=flattened, bucket_mb=args.bucket_mb,
                           **min(trials[1:], key=lambda r: r["total_s"]))
                if args.verify:
                    verify_inside_sglang([server.endpoint()], policy.received(args.bucket_mb), str(model_dir),
                                         Path(tempfile.mkdtemp(prefix="verify-")))
                    row["verified"] = True
                transport.close()
            except Exception as error:
                row = dict(model=name, transport="nccl", flattened=flattened, error=repr(error),
                           trace=traceback.format_exc()[-3000:], server_log=server.log_tail(20))
            print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "server_log")}), flush=True)
            rows.append(row)
            _write(args.out, rows)
    finally:
        server.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)
    return rows


def _write(path: str, data) -> None:
    if not path:
        return
    Path(path).write_text(json.dumps(dict(commit=source_commit(), gpu=torch.cuda.get_device_name(), results=data), indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["sync", "throughput", "nccl"])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--formats", nargs="+", default=["tensors", "flattened_bucket", "persistent"])
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--server-tp", type=int, default=1)
    parser.add_argument("--mem-fraction", type=float, default=0.35)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--out", default="")
    parser.add_argument("--log-dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    # the GPU script's `timeout` sends SIGTERM: exit through the finally blocks, which shut the servers down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.part == "throughput":
        part_throughput(args)
        return
    from megarl.parallel.state import destroy_parallel, init_parallel

    torch.cuda.set_device(0)
    init_parallel(0, 1, "127.0.0.1", 29555, device="cuda")
    try:
        (part_sync if args.part == "sync" else part_nccl)(args)
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()

"""Weight sync into real SGLang servers, and rollout throughput against SGLang's own Engine.

Parts (one process each; each writes its JSON to --out after every measurement, so one failing part, or
a time limit, loses nothing already measured):
  sync        colocated CUDA IPC through megarl's own path: SGLangRolloutEngine (colocated) and
              workers.weight_sync.PolicySync, as the trainer runs them. Per model (random Qwen2 shape,
              SGLang --load-format dummy, one server per model), per --bucket-mb and payload format of
              transports/cuda_ipc.py: a warm-up sync, then the best of --trials timed syncs from the end of
              a train step (CUDA synchronised; SGLang holds neither weights nor KV cache, as after a
              release) to SGLang ready to generate:
                resume   - begin_weight_update: SGLang takes its weights memory back,
                gather   - training-TP all-gathers (0 here: the policy is at TP=1),
                convert  - megarl.reshard yields HF-named tensors (q/k/v, gate/up cut out of
                           the fused megatron weights), time the main thread spends producing buckets,
                pack     - the format's copy into a flat buffer and the IPC handles' serialisation,
                transfer - time the main thread waits on /update_weights_from_tensor (bucket k is posted
                           in a thread while bucket k+1 is converted and packed),
                ready    - resume_kv_cache: the KV cache back (kv) and the prefix cache dropped if
                           needed (flush);
              effective GB/s = bytes / total. --weights resident measures the same without the memory
              cycle (SGLang kept its weights and KV cache: offload off), where resume and ready are ~0.
              posts: each bucket's /update_weights_from_tensor call, and of that the seconds SGLang's
              loads took inside the server (the persistent loader times itself: server_loads).
              --server-tp 2 puts one TP=2 server on GPUs 0-1 (trainer on 0).
              With --verify, after each format's timed syncs SGLang checks itself bit for bit (its weights
              checker: what the format delivered vs its own loader reading the exported tensors).
              Sync-only servers skip what only generation needs (CUDA graphs, the warm-up request): no
              forward pass runs, so start-up compiles nothing; the update path is the training one.
  throughput  megarl's rollout path (SGLangRolloutEngine.generate: HTTP, n samples, log-probs) against
              sglang.Engine.generate in-process on the same kind of requests (same n, log-probs,
              ignore_eos): one request per call, the rows in concurrent requests of SPLIT_ROWS, and with
              SGLang's memory saver (as colocated); all alive at once and measured in turns, medians over
              --rounds; and one raw /generate's wall time against SGLang's own e2e_latency
              (request_split), to place the gap.
  nccl        disaggregated: trainer on GPU 0, a TP=1 server on GPU 1, weights broadcast over NCCL
              (init_weights_update_group / update_weights_from_distributed), flattened and per-tensor,
              verified bit for bit as above.
  table       the short table of the JSON files in --out-dir, parts in --parts order.

--dry-run (any GPU part) checks the plumbing on a CPU: no server, no GPU; rows carry the sizes, zero times
and dry_run=true.

    python benchmarks/weight_sync.py sync --models qwen2.5-7b --formats persistent --out sync.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from megarl.reshard.plan import load_model_config
from megarl.utils.provenance import source_commit

# What a sync-only server skips: only generation needs CUDA graphs or the warm-up request. Without them no
# forward pass runs, so start-up JIT-compiles nothing (~45 s instead of 80-145 s on an H200); the weights
# memory, loaders and KV cache (its size: the same mem fraction) are the training run's. With CUDA graphs
# the ready step would also resume their memory pool (small next to the KV cache).
SYNC_ONLY_SERVER = dict(load_format="dummy", cuda_graph=False, extra_args=("--skip-server-warmup",),
                        env={"MEGARL_TIME_WEIGHT_LOADS": "1"})  # the loads' own seconds in the log: server_loads


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
        from megarl.reshard.inventory import hf_inventory
        from megarl.reshard.resharder import Resharder, held_rows
        from megarl.reshard.layout import TrainLayout

        hf = load_model_config(name)
        self.gpt, maps = build_policy(hf)
        self.specs = hf_inventory(hf)
        train = TrainLayout(1, 1, 1, hf["num_hidden_layers"])
        self.resharder = Resharder(self.specs, train, held_rows(self.gpt, maps, self.specs, train, 0), 0)

    def buckets(self, bucket_mb: int):
        return self.resharder.buckets(1, "full", bucket_mb << 20, torch.bfloat16)

    def received(self, bucket_mb: int) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu() for b in self.buckets(bucket_mb) for n, t in b}


def model_bytes(name: str) -> tuple[int, int]:
    """Parameters and bf16 bytes of a model config's HF tensors (what one full sync moves)."""
    from megarl.reshard.inventory import hf_inventory

    params = sum(s.numel for s in hf_inventory(load_model_config(name)))
    return params, 2 * params


def time_posts(server, seconds: dict) -> None:
    """Add the seconds each of the server's own calls takes to `seconds`, by path and memory tags (the
    engine's resume and flush calls; bucket posts go through other Endpoint objects)."""
    post = server.post

    def timed(path, payload=None, timeout=None):
        key = " ".join([path, *(payload or {}).get("tags", [])])
        start = time.perf_counter()
        try:
            return post(path, payload, timeout)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start

    server.post = timed


def server_loads(server) -> dict:
    """What the server's loads took since the last call (the MEGARL_TIME_WEIGHT_LOADS lines of its log), per
    rank summed, slowest rank: seconds inside the loader, and of those the loaders' Python work (queued)."""
    from megarl.rollout.transports.sglang_loader import LOAD_TIMING

    offset = getattr(server, "load_log_offset", 0)
    with open(server.log_path, "rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
        server.load_log_offset = log.tell()
    seconds, queued = {}, {}
    for line in text.splitlines():
        if LOAD_TIMING in line:
            fields = line.split(LOAD_TIMING + ":")[1].split()
            rank, values = fields[1], dict(zip(fields[2::2], map(float, fields[3::2])))
            seconds[rank] = seconds.get(rank, 0.0) + values["seconds"]
            queued[rank] = queued.get(rank, 0.0) + values["queued"]
    return dict(server_load_s=max(seconds.values(), default=0.0), server_queued_s=max(queued.values(), default=0.0))


def timed_sync(engine, buckets, syncs, posts: dict, weights: str = "released", expected=None,
               collect: bool = True) -> dict:
    """One colocated sync as the trainer runs it: from the end of a train step through `syncs` (a
    weight_sync.PolicySync of one CUDA IPC format, kept across its syncs, as TrainWorker keeps its own: resume
    the weights memory, stream the buckets) to resume_kv_cache. `weights`: "released", SGLang released its
    weights and KV cache during training (trainer.offload_between_phases on); "resident", it kept both
    (offload off: nothing to resume, the ready step only drops the prefix cache). `expected`: a verified sync
    (the default verification: weight_layout.ExpectedChecksums of the sender; SGLang sums nothing during the sync).
    With `collect`, after the timed sync SGLang's TP workers checksum what they hold and the two are compared,
    timed apart, as the trainer does before its next update (RLTrainer.check_rollout_weights, after generation)."""
    from megarl.workers.weight_sync import RolloutSide, verify_checksums

    if weights == "released":
        engine.release_memory()  # as during training
    else:
        engine.resume_kv_cache()  # what a previous released sync left released comes back, untimed
    server_loads(engine.servers[0])  # skip the lines of earlier syncs
    posts.clear()
    t0 = _now()
    report = syncs.push(buckets, RolloutSide.of_engine(engine), expected is not None, expected=expected)
    t1 = time.perf_counter()
    engine.resume_kv_cache()
    t2 = time.perf_counter()  # the sync as the trainer pays it
    checked = {}
    if expected is not None:
        checked = dict(expected=report.expected, sender_checksum_s=report.digest_s)
    if expected is not None and collect:
        held = engine.weight_checksums()
        t = time.perf_counter()
        verify_checksums(report.expected, held)
        checked |= dict(collect_s=t - t2, compare_s=time.perf_counter() - t,
                        parameters_checked=sum(len(r) for r in held[0].values()))
    return checked | dict(bytes=report.bytes, total_s=t2 - t0, resume_s=report.begin_s, gather_s=0.0,
                convert_s=report.gather_convert_s, pack_s=report.pack_s, transfer_s=report.transfer_s,
                end_s=report.end_s, ready_s=t2 - t1, flush_s=posts.get("/flush_cache", 0.0),
                kv_s=posts.get("/resume_memory_occupation kv_cache cuda_graph", 0.0),
                posts=len(report.posts_s), posts_s=sum(report.posts_s), post_max_s=max(report.posts_s),
                **(server_loads(engine.servers[0]) if syncs.settings.weight_format == "persistent" else {}),
                gb_per_s=report.bytes / (t2 - t0) / 1e9)


def verified(server, policy, bucket_mb: int, model_dir: Path) -> dict:
    """SGLang's own check of what it holds against what the last sync sent (raises on a mismatch)."""
    from megarl.rollout.sglang_server import verify_inside_sglang

    t = time.perf_counter()
    verify_inside_sglang([server.endpoint()], policy.received(bucket_mb), str(model_dir),
                         Path(tempfile.mkdtemp(prefix="verify-")))
    return dict(verified=True, verify_s=time.perf_counter() - t)


def checksummed(engine, policy, bucket_mb: int, syncs, posts: dict, weights: str,
                rounds: int, profile: Path | None = None) -> dict:
    """The default verification (trainer.verify_weight_sync_every=1), in medians of `rounds` rounds of one
    unverified and one verified sync (after one verified sync that compiles the kernels and plans the layout's
    pieces, as the first verification of a run does; one ExpectedChecksums serves every sync, as TrainWorker keeps
    it): (a) its cost on the sync's path, the verified sync's time minus the unverified one's, both timed as the
    trainer pays them (timed_sync: the sender's checksums in its pack; SGLang sums nothing then); (b) the deferred
    collection, timed apart: the request that has SGLang's TP workers checksum what they hold, and the comparison;
    (c) SGLang's sums' GPU time (CUDA events around them, from the server's log).
    `profile`: then one more verified sync under torch.profiler (`profiled`). Then a bit flipped in SGLang's memory
    after a verified sync and before its collection must fail that collection, naming the tensor."""
    from megarl.rollout.transports.sglang_loader import CHECKSUM_TIMING
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
    from megarl.workers.sync_checks import WeightSyncError
    from megarl.workers.weight_sync import verify_checksums

    tp = engine.servers[0].tp
    expected = ExpectedChecksums(layout_for(policy.specs, "sglang", tp), list(range(tp)))
    sync = lambda verified, collect=True: timed_sync(engine, policy.buckets(bucket_mb), syncs, posts, weights,
                                                     expected if verified else None, collect)
    first = sync(True)
    plain, checked = [], []
    for i in range(rounds):  # the order alternates, so neither kind always follows the other
        for verified in (False, True) if i % 2 == 0 else (True, False):
            (checked if verified else plain).append(sync(verified))
    median = lambda rows, k: statistics.median(r[k] for r in rows)
    # each round's own difference: the machine's drift over the rounds (wider than the cost at 7B) cancels
    paired = sorted(c["total_s"] - p["total_s"] for p, c in zip(plain, checked))
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    fields = [line.split(CHECKSUM_TIMING + ":")[1].split()
              for line in Path(engine.servers[0].log_path).read_text(errors="replace").splitlines()
              if CHECKSUM_TIMING in line]  # each collection inside SGLang's TP worker: params, seconds, sums' GPU s
    collections = [dict(zip(f[0::2], map(float, f[1::2]))) for f in fields][-rounds:]
    profiled_s = {}
    if profile is not None:
        try:
            profiled_s = profiled(lambda: sync(True), profile)
        except Exception as error:  # the profile is a diagnosis: its failure must not lose the measurements
            profiled_s = dict(profile_error=repr(error))
    flipped = "model.layers.0.mlp.down_proj.weight"
    last = sync(True, collect=False)  # verified, not collected yet
    engine.corrupt_weight(flipped)  # a bit flipped after the load: the collection must see it
    try:
        verify_checksums(last["expected"], engine.weight_checksums())
        detected = False
    except WeightSyncError as error:
        detected = flipped in str(error)
    engine.corrupt_weight(flipped)  # and back
    engine.resume_kv_cache()
    unverified, verified = median(plain, "total_s"), median(checked, "total_s")
    collect, compare = median(checked, "collect_s"), median(checked, "compare_s")
    return dict(checksums_verified=True, unverified_sync_s=unverified, verified_sync_s=verified,
                unverified_trials_s=[r["total_s"] for r in plain], verified_trials_s=[r["total_s"] for r in checked],
                checksum_verify_s=verified - unverified, paired_verify_s=statistics.median(paired),
                paired_verify_quartiles_s=[quartiles[0], quartiles[2]], deferred_collect_s=collect,
                deferred_compare_s=compare,
                verify_with_deferred_s=verified - unverified + collect + compare,
                first_verify_s=first["total_s"] - unverified,
                verified_posts_s=median(checked, "posts_s"), unverified_posts_s=median(plain, "posts_s"),
                verified_pack_s=median(checked, "pack_s"), unverified_pack_s=median(plain, "pack_s"),
                verified_server_load_s=median(checked, "server_load_s"),
                unverified_server_load_s=median(plain, "server_load_s"),
                sender_checksum_s=median(checked, "sender_checksum_s"),
                sglang_collect_inside_s=statistics.median(c["seconds"] for c in collections) if collections else None,
                sglang_sums_gpu_s=statistics.median(c.get("gpu", 0.0) for c in collections) if collections else None,
                parameters_checked=checked[-1]["parameters_checked"], flip_detected=detected, **profiled_s)


# CUDA runtime calls that make the host wait for the GPU or allocate: what a verified sync's host time must not hold
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaHostAlloc", "cudaMallocHost",
         "cudaFreeHost", "cudaMalloc", "cudaFree", "cudaMemcpy", "cudaHostRegister")


def profiled(sync: Callable[[], dict], out: Path) -> dict:
    """One verified sync under torch.profiler (megarl.utils.profiling: the ops by GPU and by host time and the chrome
    trace to `out`), the sync's own phase split (timed_sync's row) to profile_sync.json; returns the host seconds of
    each runtime call in WAITS (the calls that wait for the GPU or allocate) and of megarl's phase ranges
    (record_function "megarl.sync.*"), for the JSON row. The profiler's overhead makes this sync slower than the
    timed ones."""
    from megarl.utils.profiling import profiled as profiling

    with profiling(out, "cuda") as summary:
        row = sync()
    (out / "profile_sync.json").write_text(json.dumps({k: v for k, v in row.items() if k != "expected"}, indent=1))
    found = {}
    for event in summary["ops"]:
        if event.key.startswith(WAITS) or event.key.startswith("megarl.sync."):
            found[event.key] = dict(calls=event.count, host_s=event.cpu_time_total / 1e6)
    return dict(profiled_sync_s=row["total_s"], profiled_host_calls=found)


def _print_row(row: dict) -> None:
    print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "server_log")}), flush=True)


def part_sync(args) -> list[dict]:
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.sglang_server import sglang_server
    from megarl.workers.weight_sync import PolicySync

    rows = []
    for name in args.models:
        params, nbytes = model_bytes(name)
        if args.dry_run:
            for bucket_mb in args.bucket_mb:
                for fmt, weights in itertools.product(args.formats, args.weights):
                    rows.append(dict(model=name, params=params, format=fmt, weights=weights, server_tp=args.server_tp,
                                     bucket_mb=bucket_mb, bytes=nbytes, dry_run=True, **dict.fromkeys(TIMES, 0.0),
                                     gb_per_s=0.0, verified="planned" if args.verify else None))
                    _print_row(rows[-1])
                    _write(args, rows)
            continue
        model_dir = model_dir_for(name)
        server = sglang_server(str(model_dir), tp=args.server_tp, mem_fraction=args.mem_fraction, log_dir=args.log_dir,
                               startup_timeout=args.startup_timeout, request_timeout=120, **SYNC_ONLY_SERVER)
        policy = None
        try:
            t = time.perf_counter()
            engine = SGLangRolloutEngine(str(model_dir), tp=args.server_tp, colocated=True, launch=lambda i: server)
            startup = time.perf_counter() - t
            posts: dict[str, float] = {}
            time_posts(server, posts)
            policy = Policy(name)
            for bucket_mb in args.bucket_mb:
                for fmt, weights in itertools.product(args.formats, args.weights):
                    try:
                        syncs = PolicySync(fmt)  # one sender per format and bucket size, kept across its syncs
                        trials = [timed_sync(engine, policy.buckets(bucket_mb), syncs, posts, weights)
                                  for _ in range(args.trials + 1)][1:]  # the first warms up IPC and loader paths
                        best = min(trials, key=lambda r: r["total_s"])
                        row = dict(model=name, params=params, format=fmt, weights=weights, server_tp=args.server_tp,
                                   bucket_mb=bucket_mb, startup_s=startup, server_args=server.command[3:],
                                   trials_total_s=[r["total_s"] for r in trials], **best)
                        if args.checksums:
                            row |= checksummed(engine, policy, bucket_mb, syncs, posts, weights,
                                               args.verify_rounds, Path(args.profile_dir) if args.profile_dir else None)
                        if args.verify:
                            row |= verified(server, policy, bucket_mb, model_dir)
                    except Exception as error:  # one format failing must not lose the others
                        row = dict(model=name, format=fmt, weights=weights, server_tp=args.server_tp,
                                   bucket_mb=bucket_mb, error=repr(error), trace=traceback.format_exc()[-3000:],
                                   server_log=server.log_tail(20))
                    _print_row(row)
                    rows.append(row)
                    _write(args, rows)
        except Exception as error:
            rows.append(dict(model=name, server_tp=args.server_tp, error=repr(error),
                             trace=traceback.format_exc()[-3000:], server_log=server.log_tail(40)))
            _print_row(rows[-1])
            _write(args, rows)
        finally:
            server.shutdown()
            del policy
            torch.cuda.empty_cache()
            shutil.rmtree(model_dir, ignore_errors=True)
    return rows


SPLIT_ROWS = 64  # rows per request of the throughput part's split variant (SGLangRolloutEngine rows_per_request)
# The throughput part's generation paths, in the order of its first round: sglang.Engine in-process, then megarl's
def part_nccl(args) -> list[dict]:
    from megarl.rollout.sglang_server import free_port, sglang_server
    from megarl.rollout.transports.nccl_broadcast import NcclBroadcast

    rows = []
    name = args.models[0]
    if args.dry_run:
        params, nbytes = model_bytes(name)
        for flattened in (True, False):
            rows.append(dict(model=name, transport="nccl", flattened=flattened, bucket_mb=args.bucket_mb[0],
                             bytes=nbytes, dry_run=True, total_s=0.0, gb_per_s=0.0,
                             verified="planned" if args.verify else None))
            _print_row(rows[-1])
            _write(args, rows)
        return rows
    model_dir = model_dir_for(name)
    server = sglang_server(str(model_dir), gpu=1, mem_fraction=0.5, memory_saver=False, log_dir=args.log_dir,
                           startup_timeout=args.startup_timeout, request_timeout=120, **SYNC_ONLY_SERVER)
    try:
        t = time.perf_counter()
        server.start()
        startup = time.perf_counter() - t
        policy = Policy(name)
        bucket_mb = args.bucket_mb[0]
        for flattened in (True, False):
            try:
                transport = NcclBroadcast(server.endpoint(), "127.0.0.1", free_port(),
                                          group_name=f"megarl_{int(flattened)}", flattened=flattened)
                trials = []
                for _ in range(args.trials + 1):
                    t0 = _now()
                    nbytes = 0
                    for bucket in policy.buckets(bucket_mb):
                        transport.send_bucket(bucket, flush_cache=False)
                        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    server.post("/flush_cache")
                    t1 = _now()
                    trials.append(dict(bytes=nbytes, total_s=t1 - t0, gb_per_s=nbytes / (t1 - t0) / 1e9))
                row = dict(model=name, transport="nccl", flattened=flattened, bucket_mb=bucket_mb, startup_s=startup,
                           trials_total_s=[r["total_s"] for r in trials[1:]],
                           **min(trials[1:], key=lambda r: r["total_s"]))
                if args.verify:
                    row |= verified(server, policy, bucket_mb, model_dir)
                transport.close()
            except Exception as error:
                row = dict(model=name, transport="nccl", flattened=flattened, error=repr(error),
                           trace=traceback.format_exc()[-3000:], server_log=server.log_tail(20))
            _print_row(row)
            rows.append(row)
            _write(args, rows)
    finally:
        server.shutdown()
        shutil.rmtree(model_dir, ignore_errors=True)
    return rows


TIMES = ("total_s", "resume_s", "gather_s", "convert_s", "pack_s", "transfer_s", "end_s", "ready_s", "kv_s", "flush_s")


def _write(args, data) -> None:
    if not args.out:
        return
    gpu = "dry run (no GPU)" if args.dry_run else torch.cuda.get_device_name()
    Path(args.out).write_text(json.dumps(dict(commit=source_commit(), gpu=gpu, results=data), indent=2))


def table(out_dir: Path, parts: list[str]) -> str:
    """The short table of the parts' JSON files, in `parts` order; a part without results says so."""
    head = ("| part | model | format | tp | bucket MB | GB | total s | resume | convert | pack | transfer "
            "| ready (kv + flush) | posts: n, s (SGLang load) | GB/s | verified |")
    lines, tail = [head, "|" + " --- |" * 15], []
    for part in parts:
        try:
            data = json.loads((out_dir / f"{part}.json").read_text())
        except (OSError, ValueError):
            lines.append(f"| {part} | no results (skipped, or failed: see {part}.log) |")
            continue
        results, dry = data.get("results"), " (dry run)" if "dry run" in str(data.get("gpu")) else ""
        if part == "throughput":
            f = lambda k: f"{results.get(k, float('nan')):.0f}"
            r = lambda k: f"{results.get(k, float('nan')):.3f}"
            tail.append(f"rollout tok/s{dry} ({results.get('model')}, {results.get('prompts')} prompts "
                        f"x n={results.get('n')} x {results.get('new_tokens')} new, median of "
                        f"{results.get('rounds', 1)} rounds): megarl {f('megarl_tok_s')}, "
                        f"sglang.Engine {f('sglang_engine_tok_s')}, ratio {r('ratio')}; megarl with SGLang's memory "
                        f"saver (as colocated) {f('megarl_memory_saver_tok_s')}, ratio {r('ratio_memory_saver')}; "
                        f"megarl in requests of {SPLIT_ROWS} rows {f('megarl_split_tok_s')}, ratio {r('ratio_split')}; "
                        f"on SGLang's own clock, ratio {r('ratio_inside')}; median of the rounds' ratios "
                        f"{r('ratio_paired')}")
            if "megarl_request_wall_s" in results:
                tail.append(f"one batch, wall s (inside SGLang's tokenizer manager): sglang.Engine "
                            f"{r('sglang_engine_wall_s')} ({r('sglang_engine_inside_s')}), megarl's raw /generate "
                            f"{r('megarl_request_wall_s')} ({r('megarl_request_inside_s')})")
            if "megarl_request_parse_s" in results:
                tail.append(f"megarl's request, s: encode {r('megarl_request_encode_s')}, answered "
                            f"{r('megarl_request_answered_s')}, parse {r('megarl_request_parse_s')} "
                            f"({results['megarl_answer_mb']:.1f} MB), convert {r('megarl_request_convert_s')}")
            continue
        for r in results:
            fmt = f"nccl flattened={r['flattened']}" if r.get("transport") == "nccl" else \
                " ".join(filter(None, (r.get("format", ""), r.get("weights") == "resident" and "(resident)")))
            start = f"| {part}{dry} | {r['model']} | {fmt} | {r.get('server_tp', 1)} | {r.get('bucket_mb', '')} |"
            if "error" in r:
                lines.append(f"{start} ERROR {r['error'][:100]} |")
                continue
            x = lambda k: f"{r[k]:.3f}" if k in r else ""
            ready = f"{x('ready_s')} ({x('kv_s')} + {x('flush_s')})" if "ready_s" in r else ""
            posts = f"{r['posts']}, {x('posts_s')} ({x('server_load_s') or '-'})" if "posts" in r else ""
            lines.append(f"{start} {r['bytes'] / 1e9:.2f} | {x('total_s')} | {x('resume_s')} | {x('convert_s')} | "
                         f"{x('pack_s')} | {x('transfer_s')} | {ready} | {posts} | {r['gb_per_s']:.1f} | "
                         f"{r.get('verified') or ''} |")
    return "\n".join(lines + tail)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megarl.rollout.transports.cuda_ipc import FORMATS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["sync", "throughput", "nccl", "table"])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-1.5b", "qwen2.5-0.5b"],
                        help="model configs (configs/models/ names or config.json paths), measured in this order")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["persistent", "flattened_bucket", "tensors"],
                        help="CUDA IPC payload formats, measured in this order")
    parser.add_argument("--bucket-mb", nargs="+", type=int, default=[1024], help="bucket sizes (MiB), in this order")
    parser.add_argument("--trials", type=int, default=2, help="timed syncs per format after one warm-up")
    parser.add_argument("--weights", nargs="+", choices=["released", "resident"], default=["released"],
                        help="SGLang's memory during training: released (the colocated offload cycle: the sync "
                             "resumes its weights memory first, the ready step its KV cache) or resident (kept)")
    parser.add_argument("--server-tp", type=int, default=1)
    parser.add_argument("--mem-fraction", type=float, default=0.35,
                        help="SGLang --mem-fraction-static (the GRPO run's: the KV cache the ready step resumes)")
    parser.add_argument("--verify", action="store_true", help="SGLang checks what it received bit for bit (the deep "
                        "check: reload from a file)")
    parser.add_argument("--checksums", action="store_true", help="time the default verification (checksums inside "
                        "SGLang against the sender's) after each format's syncs, and check a flipped bit is named")
    parser.add_argument("--verify-rounds", type=int, default=25, help="with --checksums: rounds of one unverified "
                        "and one verified sync (in alternating order), whose medians' difference is the verification's "
                        "cost; also the median (and quartiles) of each round's own difference")
    parser.add_argument("--profile-dir", default="", help="with --checksums: one more verified sync under "
                        "torch.profiler, its trace and op table written here (`profiled`)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7,
                        help="throughput: measured rounds (every path once each); the JSON is rewritten after each")
    parser.add_argument("--throughput-mem-fraction", type=float, default=0.25,
                        help="throughput: SGLang --mem-fraction-static of each of the three instances on the GPU")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--out", default="", help="the part's JSON, rewritten after every measurement")
    parser.add_argument("--log-dir", default=tempfile.gettempdir(), help="SGLang server logs")
    parser.add_argument("--dry-run", action="store_true", help="no GPU, no server: sizes, order and JSON only")
    parser.add_argument("--out-dir", default="", help="table: the directory of the parts' JSON files")
    parser.add_argument("--parts", nargs="+", default=[], help="table: the parts (JSON file stems), in this order")
    args = parser.parse_args(argv)
    if args.part == "table" and not args.out_dir:
        parser.error("table needs --out-dir")
    if min(args.bucket_mb) < 1 or args.trials < 1:
        parser.error(f"--bucket-mb and --trials must be >= 1, got {args.bucket_mb} and {args.trials}")
    for name in args.models:
        try:
            load_model_config(name)
        except (OSError, ValueError) as error:
            parser.error(f"--models {name}: {error}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part == "table":
        print(table(Path(args.out_dir), args.parts))
        return
    from benchmarks.rollout_throughput import part_throughput  # its own file; it uses this one's helpers

    if args.dry_run:
        {"sync": part_sync, "nccl": part_nccl, "throughput": part_throughput}[args.part](args)
        return
    # the GPU script's `timeout` sends SIGTERM: exit through the finally blocks, which shut the servers down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.part == "throughput":
        part_throughput(args)
        return
    from megarl.parallel.state import destroy_parallel, init_parallel
    from megarl.rollout.sglang_server import free_port

    torch.cuda.set_device(0)
    init_parallel(0, 1, "127.0.0.1", free_port(), device="cuda")
    try:
        (part_sync if args.part == "sync" else part_nccl)(args)
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()

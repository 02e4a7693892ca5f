"""Multi-GPU runs: resharding into colocated SGLang servers, the disaggregated weight sync over
NCCL broadcast, and MoE expert parallelism against EP=1. One process per GPU, launched by torchrun; with
--device cpu the same code runs on gloo at tiny sizes, a recording stand-in taking the SGLang servers' place
(the smoke test before a GPU run). Rank 0 writes the JSON (--out); the exit status is 1 if a check failed.

  reshard  The policy (random Qwen2 shape, --size) at --tp x --pp (DP = the rest of the ranks) takes
           --train-steps optimizer steps; then for each --gen-tp g: world / g SGLang servers of TP=g on the
           same GPUs (dummy weights; generation TP=g x DP=world/g), and for each --delivery the sync as
           TrainWorker.push_weights does it: every rank reshards (megarl.reshard, point-to-point over
           NCCL); "full": the first rank of each generation group posts whole tensors into its server by CUDA
           IPC (weight_sync.PolicySync, as TrainWorker); "sharded" (g = --tp = world): each rank packs its own TP shard, rank 0
           posts one request per bucket with every rank's payload (cuda_ipc.ShardedIpcSender). The first
           sync is verified per server: what was sent equals the policy exported by megatron's gather path
           (engine.export_hf_weights, another code path), and SGLang holds exactly what was sent (its weights
           checker against its own loader, then digests). Then --trials timed syncs, each from the servers'
           released state (as after a train step) to every server ready to generate (barrier: the slowest
           rank): seconds, bytes per server and in all, GB/s. On the CPU the servers are the tests' fake
           SGLang (TP ranks with SGLang's sharding and presharded loading).
  disagg   The policy at --tp on all ranks (the training GPUs), one SGLang server of TP=--server-tp on the next
           GPUs; rank 0 broadcasts each resharded bucket over NCCL (transports/nccl_broadcast.py, flattened),
           verified and timed as above.
  moe      A random Qwen3-MoE (--experts, transformers' own model class) at EP=1 and at EP=world in one
           process group, fp32 and bf16: log-probs and entropy of the same batch at EP=world equal EP=1's
           (and, fp32, transformers'), also with each rank holding its own rows (lengths differ between ranks).

    torchrun --nproc-per-node 4 benchmarks/multi_gpu.py reshard --tp 2 --pp 2 --gen-tp 1 2 --out reshard.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py reshard --tp 2 --gen-tp 2 --delivery full sharded \
        --size 7b --train-steps 0 --bucket-mb 8192 --out reshard_tp2.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py disagg --tp 2 --server-tp 2 --out disagg.json
    torchrun --nproc-per-node 4 benchmarks/multi_gpu.py moe --out moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.rollout import sglang_layout
from megarl.rollout.transports import cuda_ipc
from megarl.utils.provenance import source_commit
from megarl.workers import sync_checks, weight_sync


class RecordingEngine:
    """--device cpu: stands in for a rollout engine's SGLang server, keeping what it is sent."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}

    def begin_weight_update(self):
        return None  # no endpoints: the sync hands each bucket to update_weights

    def end_weight_update(self, received) -> None:
        pass

    def update_weights(self, bucket) -> None:
        self.weights.update((n, t.detach().clone()) for n, t in bucket)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.weights

    def release_memory(self) -> None:
        pass

    def resume_kv_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _shared_dir(args, name: str) -> Path:
    """A directory every rank sees (one machine): rank 0 creates it, the others wait at the barrier."""
    path = Path(args.work_dir) / name
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def _policy(args, device: str):
    """The random policy at the launched layout after --train-steps steps, its resharder and HF directory."""
    from megatron.core import parallel_state as mpu

    from benchmarks.engine_throughput import qwen2_config, random_batch
    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
    from megarl.engine import MegatronEngine
    from megarl.engine.packing import balanced_partition, sequence_lengths
    from megarl.reshard.resharder import engine_resharder

    hf = qwen2_config(args.size, args.seq)
    model_dir = _shared_dir(args, f"{args.part}-model")
    if dist.get_rank() == 0:
        (model_dir / "config.json").write_text(json.dumps(hf))
    dist.barrier()
    actor = ActorConfig(parallel=ParallelConfig(world_size=dist.get_world_size(), tp=args.tp, pp=args.pp),
                        micro_batch_size=1, max_tokens_per_micro_batch=4 * args.seq, optim=OptimConfig(lr=1e-4))
    engine = MegatronEngine(str(model_dir), actor, AlgorithmConfig(), device, 1, max(1, args.train_steps),
                            load_hf_weights=False)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    for step in range(args.train_steps):  # the synced weights are trained ones, not megatron's init
        batch, _ = random_batch(4 * dp, args.seq // 2, args.seq, hf["vocab_size"], step)
        engine.train(batch.index(balanced_partition(sequence_lengths(batch["attention_mask"]), dp)[dp_rank]))
    return engine, engine_resharder(engine, dist.get_rank()), model_dir


def _check_against_export(engine, sent: dict | None, bucket_bytes: int) -> str | None:
    """Collective. What this rank sent (the deep check's digests by HF name, or by (name, dim, lo, hi) for a TP shard)
    against megatron's own gather of the policy (export_hf_weights); None where equal, else the mismatch."""
    dtypes = {key: dtype for key, (dtype, _) in (sent or {}).items()}
    exported = {}
    for bucket in engine.export_hf_weights(bucket_bytes):
        names = {n for n, _ in bucket}
        exported |= sync_checks.digests_of(dict(bucket), {k: d for k, d in dtypes.items()
                                                          if (k if isinstance(k, str) else k[0]) in names})
    if sent is None:
        return None
    try:
        weight_sync.verify(sent, exported)
    except sync_checks.WeightSyncError as error:
        return str(error)
    return None


def _check_rollout(rollout, sent: dict) -> str | None:
    """The rollout engine holds exactly what was sent (SGLang first checks itself: verify_inside_sglang)."""
    try:
        dtypes = {name: dtype for name, (dtype, _) in sent.items()}
        weight_sync.verify(sent, sync_checks.digests_of(rollout.named_weights(), dtypes))
    except Exception as error:  # SGLangError from its checker, or WeightSyncError
        return f"{type(error).__name__}: {error}"
    return None


def _sync(resharder, rollout, gen_tp: int, bucket_bytes: int, dtype, verify: bool, syncs: weight_sync.PolicySync,
          side: weight_sync.RolloutSide | None = None, delivery: str = "full",
          group=None) -> weight_sync.SyncReport | None:
    """One sync, as TrainWorker.push_weights does it (weight_sync.PolicySync.push): every rank reshards; full
    delivery: the rank holding a rollout engine posts whole tensors; sharded: the first generation group's ranks
    (`group`) each send their TP shard, its rank 0 (the one holding the engine) posts. `side`: how the engine is
    reached, if not as an engine in this process (RolloutSide.of_engine)."""
    buckets = resharder.buckets(gen_tp, delivery, bucket_bytes, dtype)
    if delivery == "sharded" and dist.get_rank() < gen_tp:
        talks = rollout is not None
        side = weight_sync.RolloutSide(rollout.begin_weight_update if talks else None,
                                       rollout.end_weight_update if talks else None, _no_actor_load)
        sharding = weight_sync.Sharding(group, sync_checks.shard_key(resharder.specs, gen_tp, dist.get_rank()))
        return syncs.push(buckets, side, verify, sharding=sharding)
    if rollout is None:
        for _ in buckets:  # the collectives only
            pass
        return None
    return syncs.push(buckets, side or weight_sync.RolloutSide.of_engine(rollout), verify)


def _no_actor_load(bucket):
    raise RuntimeError("the rollout engine handed out no endpoints: sharded delivery needs SGLang servers")


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def part_reshard(args, device: str) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, resharder, model_dir = _policy(args, device)
    bucket_bytes = args.bucket_mb << 20
    rows = []
    for gen_tp in args.gen_tp:
        deliveries = [d for d in args.delivery if d == "full" or gen_tp == args.tp == world]
        if deliveries != args.delivery and rank == 0:  # sharded: TrainWorker's condition, one server
            print(json.dumps(dict(part="reshard", gen_tp=gen_tp, skipped="sharded delivery needs generation TP = "
                                  f"training TP = world ({args.tp}, {world})")), flush=True)
        group = dist.new_group(list(range(gen_tp)), backend="gloo") if "sharded" in deliveries else None
        layout = dict(part="reshard", size=args.size, gen_tp=gen_tp, gen_dp=world // gen_tp,
                      train={"tp": args.tp, "pp": args.pp, "dp": world // (args.tp * args.pp)})
        rollout, error, start = None, None, time.perf_counter()
        try:
            if rank % gen_tp == 0:  # one server per generation group, on its GPUs, for every delivery
                rollout = _rollout_engine(args, device, model_dir, gen_tp, gpu=rank)
            startup_s = max(_gather(time.perf_counter() - start))
            for delivery in deliveries:
                row = layout | dict(delivery=delivery, startup_s=startup_s)
                rows.append(row)
                row |= _measure(args, device, engine, resharder, rollout, gen_tp, delivery, group, bucket_bytes)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                    _write(args, rows)  # after each layout: a later one failing keeps this one's numbers
        except Exception as err:
            error = err
            failed = layout | dict(verified=False, error=repr(err), trace=traceback.format_exc()[-3000:])
            rows.append(failed)
            if rank == 0:
                print(json.dumps({k: v for k, v in failed.items() if k != "trace"}), flush=True)
                _write(args, rows)
        finally:
            if rollout is not None:
                rollout.shutdown()
                shutil.rmtree(rollout.verify_dir, ignore_errors=True)  # the exported policy: GBs at real sizes
        if error is not None:
            raise error  # the other ranks may be stuck in a collective: end the job
    return rows


def _measure(args, device: str, engine, resharder, rollout, gen_tp: int, delivery: str, group,
             bucket_bytes: int) -> dict:
    """The first sync of `delivery`, verified (against megatron's export and inside SGLang), then --trials timed
    ones from the servers' released state to every server ready to generate."""
    from megarl.rollout.base import SamplingParams

    rank, world = dist.get_rank(), dist.get_world_size()
    if delivery == "sharded":
        sglang_layout.check_presharded_vocab(resharder.specs, gen_tp)
    syncs = weight_sync.PolicySync(serializer=cuda_ipc.plain_serializer if device == "cpu" else None)
    how = dict(delivery=delivery, group=group)
    first = _sync(resharder, rollout, gen_tp, bucket_bytes, engine.params_dtype, True, syncs, **how)
    checks = [_check_against_export(engine, first and first.sent, bucket_bytes)]
    sent = _gather(first and first.sent)  # sharded: every rank's shards make what the server holds
    if rollout is not None:
        server_sent = {k: v for r in range(rank, rank + gen_tp) for k, v in (sent[r] or {}).items()}
        checks.append(_check_rollout(rollout, server_sent))
        if device == "cuda":  # the servers serve after the sync
            gens = rollout.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
            if len(gens[0].token_ids) != 4:
                checks.append(f"generated {gens[0].token_ids} after the sync")
    failures = sum(_gather([f"rank {rank}: {c}" for c in checks if c]), [])
    trials = []
    for _ in range(args.trials):
        if rollout is not None:
            rollout.release_memory()  # as after a train step
        dist.barrier()
        t0 = _now(device)
        report = _sync(resharder, rollout, gen_tp, bucket_bytes, engine.params_dtype, False, syncs, **how)
        if rollout is not None:
            rollout.resume_kv_cache()
        _now(device)
        dist.barrier()
        trials.append((time.perf_counter() - t0, report))
    syncs.close()  # the next delivery's buffers take their memory
    del syncs
    if device == "cuda":
        torch.cuda.empty_cache()
    reports = _gather([r and dataclasses.replace(r, sent={}) for _, r in trials])
    sent_bytes = _gather(first.bytes if first else 0)
    # what one server receives: rank 0's whole tensors (full), or the sum of its TP ranks' shards (sharded)
    per_server = sum(sent_bytes[:gen_tp]) if delivery == "sharded" else max(sent_bytes)
    seconds = [t for t, _ in trials]  # rank 0's (every trial ends at a barrier)
    best = min(range(args.trials), key=seconds.__getitem__)
    total_s = seconds[best]
    slowest = max((r[best] for r in reports if r[best] is not None), key=lambda r: r.seconds)
    return dict(servers=world // gen_tp, bytes_per_rank=sent_bytes, bytes_per_server=per_server,
                bytes_total=per_server * (world // gen_tp), trials_total_s=seconds, total_s=total_s,
                gb_per_s_per_server=per_server / total_s / 1e9,
                gb_per_s_total=per_server * (world // gen_tp) / total_s / 1e9,
                slowest_sender=slowest.phases() | {"seconds": slowest.seconds},
                verified=not failures, failures=failures)


def _rollout_engine(args, device: str, model_dir: Path, tp: int, gpu: int):
    """A colocated SGLang server of TP=`tp` on GPUs [gpu, gpu + tp), dummy weights; on the CPU the fake SGLang
    server of the tests (tests/rollout/fake_sglang.py: TP ranks with SGLang's sharding, pickled tensors in place
    of CUDA IPC handles)."""
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.sglang_server import SGLangServer, free_port, sglang_server

    log_dir = args.log_dir or tempfile.gettempdir()
    if device == "cpu":
        from tests.rollout import fake_sglang

        def launch(_):
            port = free_port()
            return SGLangServer([sys.executable, fake_sglang.__file__, "--port", str(port), "--tp", str(tp),
                                 "--model-path", str(model_dir)], port, tp=tp,
                                log_path=os.path.join(log_dir, f"fake_sglang_{port}.log"), startup_timeout=60)
    else:
        def launch(_):
            return sglang_server(str(model_dir), tp=tp, gpu=gpu, mem_fraction=args.mem_fraction, load_format="dummy",
                                 cuda_graph=False, log_dir=log_dir, startup_timeout=args.startup_timeout,
                                 request_timeout=180)
    return SGLangRolloutEngine(str(model_dir), colocated=True, verify_dir=tempfile.mkdtemp(prefix=f"verify-{gpu}-"),
                               launch=launch)


def part_disagg(args, device: str) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, resharder, model_dir = _policy(args, device)
    bucket_bytes = args.bucket_mb << 20
    row = dict(part="disagg", train={"tp": args.tp, "pp": args.pp, "dp": world // (args.tp * args.pp)},
               train_gpus=world, server_tp=args.server_tp, size=args.size)
    server = transport = None
    sink = RecordingEngine() if rank == 0 else None  # what rank 0 sent, for SGLang's check (and the CPU run)
    try:
        if rank == 0 and device == "cuda":
            from megarl.rollout.sglang_server import free_port, sglang_server
            from megarl.rollout.transports.nccl_broadcast import NcclBroadcast

            t = time.perf_counter()
            server = sglang_server(str(model_dir), tp=args.server_tp, gpu=world, load_format="dummy",
                                   mem_fraction=args.mem_fraction, memory_saver=False, cuda_graph=False,
                                   log_dir=args.log_dir or tempfile.gettempdir(), startup_timeout=args.startup_timeout,
                                   request_timeout=180).start()
            row["startup_s"] = time.perf_counter() - t
            transport = NcclBroadcast(server.endpoint(), "127.0.0.1", free_port())
        def broadcast(bucket):
            if transport is not None:
                transport.send_bucket(bucket, flush_cache=False)
            if recording:
                sink.update_weights(bucket)
            return lambda: None

        trials = []
        for trial in range(args.trials + 1):  # the first is verified, not timed
            recording = trial == 0
            dist.barrier()
            t0 = _now(device)
            side = None if sink is None else weight_sync.RolloutSide(sink.begin_weight_update, sink.end_weight_update,
                                                                     broadcast)
            report = _sync(resharder, sink, args.tp, bucket_bytes, engine.params_dtype, trial == 0,
                           weight_sync.PolicySync(), side)
            if server is not None:
                server.post("/flush_cache")
            _now(device)
            dist.barrier()
            trials.append((time.perf_counter() - t0, report))
        first = trials[0][1]
        failures = [_check_against_export(engine, first and first.sent, bucket_bytes)]
        if server is not None:
            from megarl.rollout.sglang_server import verify_inside_sglang

            try:
                verify_inside_sglang([server.endpoint()], {n: t.cpu() for n, t in sink.weights.items()},
                                     str(model_dir), Path(tempfile.mkdtemp(prefix="verify-disagg-")))
            except Exception as error:
                failures.append(f"SGLang's check: {error}")
        failures = [f"rank {rank}: {f}" for f in failures if f]
        failures = sum(_gather(failures), [])
        row |= dict(verified=not failures, failures=failures)
        if rank == 0:
            timed = trials[1:]
            best = min(timed, key=lambda t: t[0])
            nbytes = best[1].bytes
            row |= dict(bytes=nbytes, trials_total_s=[t for t, _ in timed], total_s=best[0],
                        gb_per_s=nbytes / best[0] / 1e9, sender=best[1].phases() | {"seconds": best[1].seconds},
                        flattened=True)
    except Exception as error:
        row |= dict(verified=False, error=repr(error), trace=traceback.format_exc()[-3000:],
                    server_log=server.log_tail(30) if server is not None else None)
        raise
    finally:
        if rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "server_log")}), flush=True)
            _write(args, [row])
        if transport is not None:
            transport.close()
        if server is not None:
            server.shutdown()
    return [row]


def _relayout(tp: int, pp: int, ep: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)


def part_moe(args, device: str) -> list[dict]:
    from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
    from megarl.engine import MegatronEngine
    from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
    from tests.models.hf_families import qwen3_moe_config, save_random

    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = _shared_dir(args, "moe-model")
    if rank == 0:
        save_random(qwen3_moe_config(tied=False, norm_topk_prob=True, num_experts=args.experts), model_dir, seed=3)
    dist.barrier()
    batch = padded_batch(rows=8)
    reference = hf_logprobs_entropy(str(model_dir), batch) if rank == 0 else None
    real = batch["attention_mask"].bool()
    real[:, 0] = False
    mine = list(range(rank, len(batch), world))
    rows = []
    for precision, tolerance in (("fp32", args.fp32_atol), ("bf16", args.bf16_atol)):
        out = {}
        for ep in (1, world):
            _relayout(1, 1, ep)
            actor = ActorConfig(parallel=ParallelConfig(world_size=world, ep=ep), micro_batch_size=2,
                                precision=precision)
            engine = MegatronEngine(str(model_dir), actor, AlgorithmConfig(), device, 1, 1, trainable=False)
            result = engine.compute_logprobs(batch, with_entropy=True)
            out[ep] = (result["logprobs"], result["entropy"])
            if ep == world:  # each rank its own rows, of other lengths than its peers' (as the trainer splits)
                result = engine.compute_logprobs(batch.index(mine), with_entropy=True)
                own = (result["logprobs"], result["entropy"])
            del engine
        diff = lambda a, b: max((x - y).abs()[real].max().item() for x, y in zip(a, b))
        own_diff = torch.tensor([max((x - y[mine]).abs()[real[mine]].max().item() for x, y in zip(own, out[1]))],
                                device=device)
        dist.all_reduce(own_diff, op=dist.ReduceOp.MAX)
        row = dict(part="moe", precision=precision, experts=args.experts, ep=world,
                   max_abs_diff_vs_ep1=max(diff(out[world], out[1]), own_diff.item()), atol=tolerance)
        row["ok"] = row["max_abs_diff_vs_ep1"] <= tolerance
        if precision == "fp32" and rank == 0:
            row["max_abs_diff_ep1_vs_transformers"] = diff(out[1], reference)
            row["ok"] = row["ok"] and row["max_abs_diff_ep1_vs_transformers"] <= tolerance
        row["mean_logprob"] = out[1][0][real].mean().item()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    return rows


def _write(args, rows: list[dict]) -> None:
    report = {"commit": source_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu",
              "world": dist.get_world_size(), "torch": torch.__version__, "args": vars(args), "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["reshard", "disagg", "moe"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", default="1b", help="benchmarks/engine_throughput.py's SIZES (reshard, disagg)")
    parser.add_argument("--seq", type=int, default=1024, help="longest training sequence")
    parser.add_argument("--tp", type=int, default=1, help="training TP")
    parser.add_argument("--pp", type=int, default=1, help="training PP (reshard)")
    parser.add_argument("--gen-tp", type=int, nargs="+", default=[1, 2], help="generation TP of each server (reshard)")
    parser.add_argument("--delivery", nargs="+", choices=["full", "sharded"], default=["full"],
                        help="reshard: weight deliveries measured into the same servers, in order (sharded only at "
                             "generation TP = --tp = the world: each rank sends its TP shard, rank 0 posts)")
    parser.add_argument("--server-tp", type=int, default=1, help="the disaggregated server's TP, on the GPUs after "
                                                                 "the training ranks' (disagg)")
    parser.add_argument("--train-steps", type=int, default=1)
    parser.add_argument("--trials", type=int, default=3, help="timed syncs (the best is reported)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--experts", type=int, default=8, help="experts of the random Qwen3-MoE (moe)")
    parser.add_argument("--fp32-atol", type=float, default=1e-4, help="moe: fp32 log-prob/entropy tolerance")
    parser.add_argument("--bf16-atol", type=float, default=0.1, help="moe: bf16 tolerance (different GEMM shapes)")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "megarl-multi-gpu"))
    parser.add_argument("--log-dir", default="", help="SGLang server logs")
    parser.add_argument("--out", required=True, help="JSON results file (rank 0)")
    args = parser.parse_args()
    # the GPU script's `timeout` sends SIGTERM: exit through the finally blocks, which shut the servers down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.device == "cpu":
        torch.set_num_threads(1)
    from megarl.parallel.state import destroy_parallel, init_parallel

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # torchrun's own store holds MASTER_PORT
    init_parallel(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500)) + 1,
                  tp=args.tp if args.part != "moe" else 1, pp=args.pp if args.part != "moe" else 1,
                  device=args.device)
    ok = False
    try:
        rows = {"reshard": part_reshard, "disagg": part_disagg, "moe": part_moe}[args.part](args, args.device)
        ok = all(r.get("verified", r.get("ok")) for r in rows)
        if rank == 0 and args.part == "moe":
            _write(args, rows)
    finally:
        destroy_parallel()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

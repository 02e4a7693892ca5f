"""Training throughput of MegatronEngine against a bare megatron-core loop on the same model and batch.

A random-initialised Qwen2-architecture policy (default: the ~1.4B shape of notes/gpu-anchors.md:
16 layers, hidden 2048, 16 heads, 8 KV groups, FFN 5632, vocab 151936, untied) trains for a few steps
on random token sequences of lengths in [--min-len, --seq], packed into micro-batches of at most
--max-tokens tokens, bf16 on GPU. Packed rows attend through --attention (auto: varlen on GPU): varlen is
flash attention over the rows' cu_seqlens (aten's flash kernels); sdpa is PyTorch SDPA with the
block-diagonal causal mask (no flash kernel takes a mask). Both loops below use the same core-attention
module on the same packed inputs (megarl.engine.attention.packed_attention_inputs):

  engine - MegatronEngine.train(batch, loss="policy"): PPO-clip loss on random advantages, with the
           per-token log-probs and entropy from vocab-parallel logits, one optimizer step per call;
  bare   - megatron-core alone: the same GPTModel spec, DDP, optimizer and pipeline schedule on the
           same packed micro-batches, with megatron's fused vocab-parallel cross entropy as the loss.

--packing picks the engine's micro-batch layout (actor.packing): rows (rows as wide as the longest sequence)
or one_row (one row of --max-tokens per micro-batch, cut to its used length); both runs an engine of each, one
after the other ("engine", then "engine_one_row" in the JSON). Every loop reports the token slots its
micro-batches compute against the real tokens in them (padding_share); the bare loop packs in rows.
--fused-kernels (actor.fused_kernels: SwiGLU and RoPE as one Triton kernel each, GPU only) on, off, or both
(then "engine_unfused" too); the bare loop runs megatron's defaults (unfused, as megatron without
TransformerEngine does).

With --sequence-parallel (TP > 1) both run under sequence parallelism, and before timing the engine's
log-probs are compared with an engine without it holding the same weights (sp_check in the JSON).
With --cp N (context parallelism: megarl/engine/context_parallel.py, attention=sdpa) the engine runs alone
(the bare loop has no CP attention); after timing, its log-probs are compared with a CP=1 engine holding the
same weights on the same ranks (cp_check in the JSON).

Reported per step (after --warmup steps): real (non-padding) tokens/s and model FLOPs utilisation

  MFU = (6 * N * T + 12 * L * h * sum_i n_i^2) / step_seconds / (PEAK_FLOPS * GPUs)

N = parameters of all 2-D weights except the input embedding (the output layer included), T = real tokens
in the step, L layers, h hidden size, n_i the length of sequence i. This is the formula of
notes/gpu-anchors.md, 6 * N * T + 12 * L * h * s * T, with the attention term summed per sequence
(a token of sequence i attends to its n_i tokens; equal lengths s give sum_i n_i^2 = s * T).
PEAK_FLOPS = 989e12: the dense bf16 tensor-core peak of one H100/H200 SXM (no sparsity).

On the H200 (one GPU; more through torchrun: DP = ranks / (TP * PP), e.g. TP=2 x PP=2 on four GPUs):
    python benchmarks/engine_throughput.py --out benchmarks/results/engine_throughput_h200.json
    python benchmarks/engine_throughput.py --packing both --out benchmarks/results/engine_throughput_h200_packing.json
    python benchmarks/engine_throughput.py --packing both --max-tokens 0 --micro-batch-size 4 --out ...  # defaults
    torchrun --nproc-per-node 2 benchmarks/engine_throughput.py --tp 2 --out benchmarks/results/engine_throughput_h200_tp2.json
    torchrun --nproc-per-node 2 benchmarks/engine_throughput.py --tp 2 --sequence-parallel --out ...
    torchrun --nproc-per-node 4 benchmarks/engine_throughput.py --tp 2 --pp 2 --out ...
    torchrun --nproc-per-node 2 benchmarks/engine_throughput.py --cp 2 --attention sdpa --skip-bare --out ...
On a CPU, a tiny model for a smoke test:
    python benchmarks/engine_throughput.py --size tiny --packing both --out /tmp/engine_throughput.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from megarl.utils.profiling import profiled, synced_now
from megarl.utils.provenance import source_commit

PEAK_FLOPS = 989e12  # bf16 dense, one H100/H200 SXM
SIZES = {
    # the shape measured in notes/gpu-anchors.md (1.38B parameters)
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=151936),
    # Qwen2.5-7B's shape (7.6B parameters)
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064),
    # Qwen2.5-0.5B's shape (0.49B parameters, tied embeddings): the e2e benchmarks' model
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    # vocabulary a multiple of 64 x TP: SGLang's presharded embedding loading takes it (sharded delivery)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024),
}


def qwen2_config(size: str, seq: int) -> dict:
    return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
                max_position_embeddings=max(seq, 4096), tie_word_embeddings=False, hidden_act="silu",
                rope_theta=1000000.0, torch_dtype="bfloat16") | SIZES[size]


def flop_parameters(hf: dict) -> int:
    """N: the 2-D weights but the input embedding (a lookup): q/k/v, output projection, gate/up/down, LM head (a
    tied one too: its matrix multiply is computed all the same)."""
    h, ffn = hf["hidden_size"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * (h // hf["num_attention_heads"])
    return hf["num_hidden_layers"] * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + h * hf["vocab_size"]


def model_flops(hf: dict, lengths: list[int]) -> float:
    """FLOPs of one training step (forward + backward) by the formula in the module docstring."""
    attention = 12 * hf["num_hidden_layers"] * hf["hidden_size"] * sum(n * n for n in lengths)
    return 6 * flop_parameters(hf) * sum(lengths) + attention


def random_batch(n: int, min_len: int, max_len: int, vocab: int, seed: int):
    from megarl.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    attention_mask = (torch.arange(max_len)[None] < lengths[:, None]).long()
    tokens = torch.randint(0, vocab, (n, max_len), generator=g) * attention_mask
    loss_mask = attention_mask.float()
    loss_mask[:, 0] = 0
    advantages = torch.randn(n, max_len, generator=g) * loss_mask
    return Batch({"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask,
                  "advantages": advantages, "old_logprobs": torch.zeros(n, max_len)}), lengths.tolist()


def _timed(step, steps: int, warmup: int, device: str) -> list[float]:
    times = []
    for i in range(warmup + steps):
        start = synced_now(device)
        step()
        end = synced_now(device)
        if i >= warmup:
            times.append(end - start)
    return times


class BareLoop:
    """megatron-core without megarl: GPTModel + DDP + optimizer + the pipeline schedule; loss = megatron's
    vocab-parallel cross entropy of the next token, averaged over the real tokens."""

    def __init__(self, hf: dict, tp: int, dtype: torch.dtype, device: str, attention: str, lr: float,
                 sequence_parallel: bool = False, pp: int = 1):
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        from megarl.engine.attention import with_core_attention
        from megarl.models import get_family
        from megarl.engine.packing import reset_rotary_positions
        from megarl.models.decoder import decoder_block_spec

        family = get_family(hf)
        config = family.transformer_config(hf, tp, pp, dtype, use_cpu_initialization=device == "cpu",
                                           ep=parallel_state.get_expert_model_parallel_world_size())
        config = dataclasses.replace(config, sequence_parallel=sequence_parallel)
        spec = decoder_block_spec(lambda layer: with_core_attention(family.layer_spec(hf, layer), attention), config)
        gpt = GPTModel(config, spec, pre_process=parallel_state.is_pipeline_first_stage(),
                       post_process=parallel_state.is_pipeline_last_stage(), **family.gpt_model_kwargs(hf, tp))
        reset_rotary_positions(gpt)  # RoPE by the packed position ids, as the engine does
        gpt = gpt.to(torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else device)
        module = Float16Module(config, gpt) if dtype == torch.bfloat16 else gpt
        self.model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, bf16=dtype == torch.bfloat16, params_dtype=dtype),
            [self.model])
        self.forward_backward = get_forward_backward_func()
        self.attention = attention

    def step(self, mbs: list[dict], total_tokens: float) -> float:
        from megarl.engine.attention import packed_attention_inputs
        from megarl.engine.packing import next_tokens

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            mask, packed_seq_params = packed_attention_inputs(self.attention, mb)
            labels = next_tokens(mb["tokens"])
            # predict the next token of the same sequence only
            weight = ((mb["doc_ids"] > 0) & (next_tokens(mb["doc_ids"]) == mb["doc_ids"])).float()
            loss = model(mb["tokens"], mb["position_ids"], mask, labels=labels, packed_seq_params=packed_seq_params)

            def loss_fn(per_token):
                value = (per_token.float() * weight).sum() / total_tokens
                return value * len(mbs), {"loss": value.detach()}

            return loss, loss_fn

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self.forward_backward(forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model],
                                    num_microbatches=len(mbs), seq_length=mbs[0]["tokens"].shape[1],
                                    micro_batch_size=mbs[0]["tokens"].shape[0], forward_only=False)
        self.optimizer.step()
        return float(sum(o["loss"] for o in out)) if out else 0.0


def _release(device: str) -> None:
    """Free a finished loop's GPU memory before the next one is measured: Megatron's modules hold reference cycles,
    so `del` alone leaves their tensors allocated until the collector runs."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _report(name: str, times: list[float], tokens: int, flops: float, gpus: int, peak: float) -> dict:
    step = sum(times) / len(times)
    result = {"step_seconds": times, "mean_step_seconds": step, "tokens_per_s": tokens / step,
              "tokens_per_s_per_gpu": tokens / step / gpus, "mfu": flops / step / (peak * gpus)}
    print(f"{name:>6}: {step * 1e3:8.1f} ms/step  {result['tokens_per_s']:10.0f} tok/s  "
          f"{result['tokens_per_s_per_gpu']:10.0f} tok/s/GPU  MFU {100 * result['mfu']:5.1f}%")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--seq", type=int, default=2048, help="longest sequence")
    parser.add_argument("--min-len", type=int, default=0, help="shortest sequence (0 = seq / 2)")
    parser.add_argument("--sequences", type=int, default=64, help="sequences per step (the global batch)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="actor.max_tokens_per_micro_batch")
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="actor.micro_batch_size; with --max-tokens 0, the defaults: padded rows of this many "
                             "(rows; the bare loop too), one row of this many x the longest sequence (one_row, varlen)")
    parser.add_argument("--packing", choices=["rows", "one_row", "both"], default="rows",
                        help="actor.packing of the engine; both: an engine of each, one after the other")
    parser.add_argument("--fused-kernels", choices=["on", "off", "both"], default="on",
                        help="actor.fused_kernels of the engine (SwiGLU and RoPE as Triton kernels, GPU only); both: an engine "
                             "of each (the second named ..._unfused)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages (data-parallel size = ranks / (tp * pp * cp))")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (engine only: implies --skip-bare)")
    parser.add_argument("--attention", choices=["auto", "varlen", "sdpa", "local"], default="auto",
                        help="core attention (auto: varlen on GPU where torch has it, else sdpa)")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (TP > 1)")
    parser.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="the engine's actor.precision (auto: bf16 on GPU); fp32 makes the SP/CP checks exact "
                             "up to kernel order, where bf16 rounding would hide a small error")
    parser.add_argument("--peak-flops", type=float, default=PEAK_FLOPS, help="per-GPU peak the MFU divides by")
    parser.add_argument("--skip-bare", action="store_true")
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--profile", default=None, help="a directory: one more step of each loop under "
                        "torch.profiler, its op tables and chrome trace there (profile_<loop>/)")
    args = parser.parse_args()

    from megatron.core import parallel_state

    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig, TrainerConfig
    from megarl.engine import MegatronEngine
    from megarl.engine.attention import resolve_core_attention
    from megarl.engine.packing import balanced_partition, pack_micro_batches, sequence_lengths
    from megarl.parallel.state import destroy_parallel, init_parallel

    # the host threads a training rank runs with (TrainWorker): torch's default, one per core of the host, made every
    # small CPU op of the micro-batch building take milliseconds on a 16-core share of a larger GPU host
    torch.set_num_threads(TrainerConfig().threads_per_rank)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    attention = resolve_core_attention(args.attention, device, args.cp)
    sp = args.sequence_parallel and args.tp > 1
    args.skip_bare = args.skip_bare or args.cp > 1
    print(f"attention={attention} sequence_parallel={sp} tp={args.tp} pp={args.pp} cp={args.cp} device={device} "
          f"torch={torch.__version__}")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        addr = "127.0.0.1"
    else:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    init_parallel(rank, world, addr, port, tp=args.tp, pp=args.pp, device=device, seed=1, cp=args.cp)
    try:
        hf = qwen2_config(args.size, args.seq)
        model_dir = Path(tempfile.mkdtemp(prefix="engine-throughput-"))
        (model_dir / "config.json").write_text(json.dumps(hf))
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        batch, lengths = random_batch(args.sequences, args.min_len or args.seq // 2, args.seq, hf["vocab_size"], 0)
        share = batch.index(balanced_partition(sequence_lengths(batch["attention_mask"]), dp)[dp_rank])
        flops = model_flops(hf, lengths)
        gpus = world if device == "cuda" else 1
        tokens = sum(lengths)
        results = {}

        if not args.skip_bare:
            bare = BareLoop(hf, args.tp, dtype, device, attention, lr=1e-5, sequence_parallel=sp, pp=args.pp)
            mbs = pack_micro_batches(share, [], _device(device), args.micro_batch_size, args.max_tokens,
                                     width_multiple=args.tp if sp else 1)
            targets = float(sum(lengths) - len(lengths))  # next-token targets in the whole batch, all DP ranks
            results["bare"] = _report("bare", _timed(lambda: bare.step(mbs, targets),
                                                     args.steps, args.warmup, device), tokens, flops, gpus,
                                      args.peak_flops)
            results["bare"] |= padding_share(mbs)
            if args.profile:
                results["bare"]["profile"] = profiled_step(lambda: bare.step(mbs, targets), Path(args.profile), "bare",
                                                           device)
            del bare, mbs
            _release(device)

        packings = ("rows", "one_row") if args.packing == "both" else (args.packing,)
        fusions = {"on": (True,), "off": (False,), "both": (True, False)}[args.fused_kernels]
        for packing, fused in ((p, f) for p in packings for f in fusions):
            name = ("engine_one_row" if args.packing == "both" and packing == "one_row" else "engine") + \
                ("_unfused" if args.fused_kernels == "both" and not fused else "")
            actor = ActorConfig(parallel=ParallelConfig(world_size=world, tp=args.tp, pp=args.pp, cp=args.cp,
                                                        sequence_parallel=sp),
                                micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=args.max_tokens,
                                packing=packing, fused_kernels=fused,
                                attention=attention, recompute=args.recompute, precision=args.precision,
                                optim=OptimConfig(lr=1e-5))
            held_before = torch.cuda.memory_allocated() if device == "cuda" else 0  # 0 once the last loop is freed
            engine = MegatronEngine(str(model_dir), actor, AlgorithmConfig(), device, 1, args.steps + args.warmup,
                                    load_hf_weights=False)
            if sp:
                results[f"sp_check_{packing}"] = sp_check(engine, actor, str(model_dir), share, device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            results[name] = _report(name, _timed(lambda: engine.train(share, loss="policy"), args.steps,
                                                 args.warmup, device), tokens, flops, gpus, args.peak_flops)
            results[name] |= {"packing": packing, "fused_kernels": fused}
            if args.profile:
                results[name]["profile"] = profiled_step(lambda: engine.train(share, loss="policy"),
                                                         Path(args.profile), name, device)
            # the micro-batches the engine computes (its own packing of this rank's share)
            results[name] |= padding_share(engine._micro_batches(share, []))
            if device == "cuda":
                # the engine's own peak (weights, optimizer, activations): what an earlier loop left is not counted
                results[name]["peak_memory_gib"] = (torch.cuda.max_memory_allocated() - held_before) / 2**30
                results[name]["held_before_gib"] = held_before / 2**30
            if "bare" in results:
                ratio = results[name]["tokens_per_s"] / results["bare"]["tokens_per_s"]
                results[f"{name}_over_bare"] = ratio
                print(f"{name} / bare throughput: {100 * ratio:.1f}%")
            if args.cp > 1:
                results[f"cp_check_{packing}"] = cp_check(engine, actor, str(model_dir), share, device)
            del engine
            _release(device)
        if rank == 0:
            report = {"commit": source_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "gpus": gpus,
                      "torch": torch.__version__, "args": vars(args), "attention": attention,
                      "sequence_parallel": sp, "layout": {"tp": args.tp, "pp": args.pp, "cp": args.cp, "dp": dp},
                      "model": hf,
                      "flop_parameters": flop_parameters(hf),
                      "tokens_per_step": tokens, "flops_per_step": flops, "peak_flops_per_gpu": args.peak_flops,
                      "flops_formula": "6*N*T + 12*L*h*sum(n_i^2), N = 2-D weights except the input embedding",
                      **results}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2))
            print(f"wrote {args.out}")
            print_summary(results)
    finally:
        destroy_parallel()


def profiled_step(step, out: Path, name: str, device: str) -> dict:
    """One more step under torch.profiler, its op tables and trace in out/profile_<name>; its wall seconds."""
    with profiled(out / f"profile_{name}", device) as summary:
        step()
    return {"wall_s": summary["wall_s"]}


def padding_share(mbs: list[dict]) -> dict:
    """Token slots the model computes (rows x width, summed over micro-batches) against the real tokens in them."""
    slots = sum(mb["tokens"].numel() for mb in mbs)
    real = sum(int((mb["doc_ids"] > 0).sum()) for mb in mbs)
    return {"micro_batches": len(mbs), "token_slots": slots, "real_tokens": real, "padding_share": 1 - real / slots}


def print_summary(results: dict) -> None:
    """The last lines: one per loop, its layout, padding share, MFU and (engine, GPU) peak memory."""
    print(f"{'loop':>16} {'packing':>8} {'mbs':>5} {'slots':>9} {'real':>9} {'padding':>8} {'ms/step':>9} {'MFU':>6} "
          f"{'peak GiB':>8}")
    for name, r in results.items():
        if isinstance(r, dict) and "mfu" in r:
            peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
            print(f"{name:>16} {r.get('packing', 'rows'):>8} {r['micro_batches']:>5} {r['token_slots']:>9} "
                  f"{r['real_tokens']:>9} {100 * r['padding_share']:>7.1f}% {1e3 * r['mean_step_seconds']:>9.1f} "
                  f"{100 * r['mfu']:>5.1f}% {peak:>8}")


def sp_check(engine, actor, model_dir: str, batch, device: str) -> dict:
    """The engine's log-probs under sequence parallelism against an engine without it (a frozen one, same
    weights copied in) on the same batch: they differ only by bf16 rounding (reduce-scatter + all-gather
    instead of all-reduce)."""
    from megarl.config import AlgorithmConfig
    from megarl.engine import MegatronEngine

    plain = dataclasses.replace(actor, parallel=dataclasses.replace(actor.parallel, sequence_parallel=False))
    reference = MegatronEngine(model_dir, plain, AlgorithmConfig(), device, 1, 1, load_hf_weights=False,
                               trainable=False)
    assert not reference.gpt.config.sequence_parallel and engine.gpt.config.sequence_parallel
    reference.gpt.load_state_dict(engine.gpt.state_dict())
    with_sp = engine.compute_logprobs(batch)["logprobs"]
    without = reference.compute_logprobs(batch)["logprobs"]
    del reference
    return _compare_logprobs("sequence parallel", with_sp, without, batch)


def cp_check(engine, actor, model_dir: str, batch, device: str) -> dict:
    """The engine's log-probs under context parallelism against a CP=1 engine (frozen, same weights copied in)
    on the same ranks, megatron's groups rebuilt without CP (the CP ranks become data-parallel ones, each
    computing the whole batch): they differ only by bf16 rounding. Leaves the process without CP groups."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import AlgorithmConfig
    from megarl.engine import MegatronEngine

    with_cp = engine.compute_logprobs(batch)["logprobs"]
    weights = engine.gpt.state_dict()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1)
    plain = dataclasses.replace(actor, parallel=dataclasses.replace(actor.parallel, cp=1), attention="sdpa")
    reference = MegatronEngine(model_dir, plain, AlgorithmConfig(), device, 1, 1, load_hf_weights=False,
                               trainable=False)
    assert reference.gpt.config.context_parallel_size == 1 and engine.gpt.config.context_parallel_size > 1
    reference.gpt.load_state_dict(weights)
    without = reference.compute_logprobs(batch)["logprobs"]
    del reference
    return _compare_logprobs("context parallel", with_cp, without, batch)


def _compare_logprobs(name: str, with_it, without, batch) -> dict:
    """Differences over the real predicted positions (not t=0, not padding); ok within bf16 rounding."""
    real = batch["attention_mask"].bool()
    real[:, 0] = False
    diff = (with_it - without).abs()[real]
    result = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
              "mean_logprob": without[real].mean().item()}
    result["ok"] = result["mean_abs_diff"] < 0.01 and result["max_abs_diff"] < 0.5
    print(f"{name} vs none, log-probs: {result}")
    return result


def _device(device: str):
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


if __name__ == "__main__":
    main()

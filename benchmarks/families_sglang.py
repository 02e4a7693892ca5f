"""Every model family SGLang serves, through megarl's own path on one GPU: a tiny random checkpoint, a real SGLang server
colocated with the Megatron engine, one training step, the weight sync verified inside SGLang, and the log-prob gap.

Per family (scripts/gpu/families.sh runs it; each family in its own try block, so one failure keeps the rest):
  build   a random bf16 checkpoint written by transformers from the tests' tiny configs (tests/models/hf_families.py)
          at sizes SGLang's kernels take (hidden 256, head_dim 64, vocabulary 512; DeepSeek-V3's own MLA head
          dimensions, benchmarks/deepseek_sglang.py), matrices N(0, 1/fan_in), the output layer 4x that (peaked
          next-token distributions, so a wrong weight moves log-probs visibly);
  serve   SGLangRolloutEngine (megarl.rollout.sglang: its own server launcher, colocated: memory saver, released
          between phases) on the checkpoint; `startup_s`;
  load    MegatronEngine on the same checkpoint; SGLang's greedy continuations of random prompts, scored by megatron on
          the same tokens: `loaded` (SGLang's own load against megarl's import);
  train   SGLang releases its memory; one SFT Adam step of megatron towards random continuations of the prompts
          (--lr: every trained weight moves by ~lr); `moved`: how far that moves megatron's log-probs of SGLang's
          continuations;
  sync    megarl.reshard's buckets through workers.weight_sync.PolicySync into SGLang (CUDA IPC, "persistent"), full
          HF tensors per bucket, verified by checksums of every parameter inside SGLang's TP worker
          (weight_layout.ExpectedChecksums against SGLang's own sums) or, for the stacked-expert families (gpt-oss), by
          the deep check (SGLang reloads what was sent with its own loader and compares; digests of the rest);
  compare SGLang's greedy continuations of the same prompts after the sync, scored by megatron: `synced`: mean and max
          |log-prob diff|, k3 KL (r - log r - 1, r = p_megatron / p_sglang). Pass: verified (the served weights are
          the trained ones, bit for bit) and `synced` mean below --max-gap (bf16 numerics of the two engines).

--device cpu (the CPU smoke): the same with megarl's transformers rollout engine (HFRolloutEngine, fp32) in place of
SGLang, verified by its checksums, plus the SGLang layout's names of every tensor sent (`sglang_params`: the SGLang
parameters the sync reaches against every parameter the layout says SGLang holds).

    python benchmarks/families_sglang.py --out families.json --families llama qwen3 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

VOCAB = 512  # a multiple of 64: SGLang's padded vocabulary is the checkpoint's
BASE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=4096)
LINEAR_ATTENTION = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                        linear_value_head_dim=64)
MOE = dict(moe_intermediate_size=128)
OUTPUT_SCALE = 4.0


@dataclass(frozen=True)
class Family:
    """`config`: the transformers config (None: `build` writes the checkpoint itself); `sglang_args`: what SGLang
    needs for megarl's layout of it (rollout.sglang_args); `deep`: verified by SGLang's reload (stacked experts)."""

    config: Callable[[], object] | None = None
    build: Callable[[Path, int], None] | None = None
    sglang_args: tuple[str, ...] = ()
    deep: bool = False


def _with(config, **fields):
    config.update(fields)
    return config


def _gpt_oss():
    from transformers import GptOssConfig

    # alternating 16-token windows (shorter than prompt + continuation) and full attention; sinks; YaRN
    return GptOssConfig(**BASE | {"intermediate_size": 256}, num_hidden_layers=2, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"], num_local_experts=8, num_experts_per_tok=2,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                             beta_slow=1.0, truncate=False, original_max_position_embeddings=1024),
                        architectures=["GptOssForCausalLM"])


def _qwen3_vl():
    from tests.models.hf_qwen3_vl import qwen3_vl_config

    config = qwen3_vl_config()
    text = {k: v for k, v in BASE.items() if k != "max_position_embeddings"}
    config.text_config.update(text | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [16, 8, 8], "mrope_interleaved": True}})
    config.vision_config.update(dict(hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=256))
    return config


def _deepseek_v3(directory: Path, seed: int) -> None:
    from benchmarks.deepseek_sglang import build_checkpoint, deepseek_config

    build_checkpoint(deepseek_config(layers=2, hidden=512, heads=8, experts=16, vocab=VOCAB, moe_intermediate=256,
                                     intermediate=1024, dense=1), directory, seed)


def families() -> dict[str, Family]:
    from tests.models import hf_families as hf

    fusion = ("--disable-shared-experts-fusion",)
    return {
        "llama": Family(lambda: _with(hf.llama_config(tied=False), **BASE | {"max_position_embeddings": 131072})),
        "qwen3": Family(lambda: _with(hf.qwen3_config(tied=False), **BASE)),
        "qwen3_moe": Family(lambda: _with(hf.qwen3_moe_config(tied=False, norm_topk_prob=True, num_experts=8),
                                          **BASE, **MOE)),
        "mistral": Family(lambda: hf.mistral_config(**BASE, sliding_window=None)),
        "mixtral": Family(lambda: hf.mixtral_config(**BASE | {"intermediate_size": 256}, num_local_experts=8)),
        "gemma3": Family(lambda: hf.gemma3_config(**BASE, sliding_window=16, query_pre_attn_scalar=64)),
        "glm4_moe": Family(lambda: hf.glm4_moe_config(**BASE, **MOE)),
        "gpt_oss": Family(_gpt_oss, deep=True),
        "qwen3_5": Family(lambda: hf.qwen3_5_config(**BASE, **LINEAR_ATTENTION)),
        "qwen3_next": Family(lambda: hf.qwen3_next_config(**_moe_hybrid()), sglang_args=fusion),
        "qwen3_5_moe": Family(lambda: hf.qwen3_next_config(moe_text=True, **_moe_hybrid()), sglang_args=fusion),
        "deepseek_v3": Family(build=_deepseek_v3),
        "qwen3_vl": Family(_qwen3_vl),
    }


def _moe_hybrid() -> dict:
    base = {k: v for k, v in BASE.items() if k != "intermediate_size"}
    return base | LINEAR_ATTENTION | MOE | dict(shared_expert_intermediate_size=256)


def _published_keys(config) -> None:
    """Keys the published checkpoints' config.json carry that transformers' config classes leave out and SGLang
    reads at start-up: Qwen3.5's and Qwen3-Next's full_attention_interval (SGLang derives each layer's token mixer
    from it, not from layer_types), gpt-oss's swiglu_limit."""
    text = getattr(config, "text_config", config)
    kinds = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" in kinds:
        interval = kinds.index("full_attention") + 1
        if kinds != [("full_attention" if (i + 1) % interval == 0 else "linear_attention") for i in range(len(kinds))]:
            raise ValueError(f"layer_types {kinds} follow no full_attention_interval, which SGLang needs")
        text.full_attention_interval = interval
    if text.model_type == "gpt_oss":
        text.swiglu_limit = 7.0


def write_checkpoint(config, directory: Path, seed: int) -> None:
    """transformers' model for `config`, norms as it initialises them + 0.1 N(0, 1), biases and routing biases 0.1 N(0, 1), matrices
    N(0, 1/fan_in) (an untied embedding and output layer OUTPUT_SCALE times that), the rest as transformers initialises it
    (A_log, dt_bias, sinks); saved in bf16."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:  # around transformers' 1 (or 0 for a (1 + weight) norm: Gemma 3, Qwen3.5)
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2:
                # a tied head reads the embedding: at OUTPUT_SCALE the token's own embedding, which Gemma scales by
                # sqrt(hidden) into the residual, would outweigh the layers and every next token be the last one
                output = "lm_head" in name or ("embed_tokens" in name and not config.tie_word_embeddings)
                scale = OUTPUT_SCALE if output else 1.0
                p.copy_(torch.randn_like(p) * scale / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    if getattr(config, "eos_token_id", None) is None:  # megarl's engines read it; continuations ignore it
        config.eos_token_id = 1
    _published_keys(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    if hasattr(config, "vision_config"):  # the image processor SGLang's multimodal path loads with the model
        from transformers import Qwen2VLImageProcessorPil

        v = config.vision_config
        Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                 temporal_patch_size=v.temporal_patch_size).save_pretrained(directory)


def build(family: Family, directory: Path, seed: int) -> dict:
    if family.build is not None:
        family.build(directory, seed)
    else:
        write_checkpoint(family.config(), directory, seed)
    return json.loads((directory / "config.json").read_text())


def init_megatron(device: str) -> None:
    """One training rank (world size 1) for every family of the run."""
    import socket

    from megarl.parallel.state import init_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_parallel(0, 1, "127.0.0.1", port, device=device)


def score(engine, prompts: list[list[int]], generations) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's log-probs of each generation's tokens after its prompt (one row each, unpadded when the
    continuations are equal in length), and the rollout engine's, both flat."""
    from megarl.protocol import Batch

    rows = [prompts[g.prompt_index] + g.token_ids for g in generations]
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    out = engine.compute_logprobs(Batch({"tokens": tokens, "attention_mask": mask}))["logprobs"]
    ours = torch.cat([out[i, len(prompts[g.prompt_index]):len(rows[i])].float().cpu()
                      for i, g in enumerate(generations)])
    theirs = torch.cat([torch.tensor(g.logprobs, dtype=torch.float32) for g in generations])
    return ours, theirs


def gap(megatron: torch.Tensor, rollout: torch.Tensor) -> dict:
    diff = (megatron - rollout).abs()
    log_r = (megatron - rollout).clamp(-20, 20)
    return dict(tokens=diff.numel(), mean_abs_diff=diff.mean().item(), max_abs_diff=diff.max().item(),
                k3_kl=(torch.exp(log_r) - log_r - 1).mean().item(), mean_logprob=rollout.mean().item())


def sft_batch(prompts: list[list[int]], new_tokens: int, seed: int):
    """The prompts with random continuations as SFT targets (loss on those): a step that moves the policy away from
    its greedy answers without making any of them certain (training on them would, and hide the log-prob gap)."""
    from megarl.protocol import Batch

    g = torch.Generator().manual_seed(seed + 1000)
    tokens = torch.cat([torch.tensor(prompts), torch.randint(2, VOCAB, (len(prompts), new_tokens), generator=g)], 1)
    loss_mask = torch.zeros(tokens.shape)
    loss_mask[:, len(prompts[0]):] = 1
    return Batch({"tokens": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": loss_mask})


def rollout_engine(args, directory: Path, family: Family):
    if args.device == "cpu":
        from megarl.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(str(directory), device="cpu", dtype=torch.float32)
    from megarl.rollout.sglang import SGLangRolloutEngine

    # as megarl.workers.rollout_worker.make_engine starts it for a colocated run
    return SGLangRolloutEngine(str(directory), tp=1, colocated=True, mem_fraction=args.mem_fraction,
                               weight_format="persistent", log_dir=args.log_dir, extra_args=family.sglang_args,
                               dtype="bfloat16", cuda_graph=args.cuda_graph, startup_timeout=args.startup_timeout,
                               verify_dir=str(directory / "sglang_verify"))


def sync_and_verify(args, engine, rollout, hf: dict, family: Family) -> dict:
    """One full-delivery sync of the trained policy into `rollout`, verified as the trainer verifies it."""
    from megarl.reshard.layout import GenLayout
    from megarl.reshard.resharder import engine_resharder
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
    from megarl.workers.sync_checks import digests_of
    from megarl.workers.weight_sync import PolicySync, RolloutSide, verify, verify_checksums

    resharder = engine_resharder(engine, 0)
    kind = "hf" if args.device == "cpu" else "sglang"
    deep = family.deep and kind == "sglang"
    expected = None if deep else ExpectedChecksums(
        layout_for(resharder.specs, kind, 1, hf=hf, sglang_args=family.sglang_args), [0])
    sent: dict[str, torch.Tensor] = {}

    def buckets():
        for bucket in resharder.buckets(GenLayout(1), "full", args.bucket_mb << 20, engine.params_dtype):
            sent.update((n, t.detach().to("cpu", copy=True)) for n, t in bucket)
            yield bucket

    if args.device == "cuda":
        torch.cuda.synchronize()
    if kind == "sglang":  # the training rank posts each bucket to SGLang's endpoints itself
        side = RolloutSide.of_engine(rollout)
    else:  # the transformers engine loads each bucket (as the rollout actor does)
        side = RolloutSide(None, None, lambda bucket: rollout.update_weights(bucket) or (lambda: None))
    sync = PolicySync("persistent")
    try:
        report = sync.push(buckets(), side, True, expected=expected)
        t = time.perf_counter()
        if deep:
            verify(report.sent, digests_of(rollout.named_weights(), {k: d for k, (d, _) in report.sent.items()}))
        else:
            verify_checksums(report.expected, rollout.weight_checksums())
        row = dict(sync_s=report.seconds - report.digest_s, sync_bytes=report.bytes, direct=report.direct,
                   verification="deep (SGLang's reload)" if deep else f"checksums ({kind})",
                   verify_s=report.digest_s + time.perf_counter() - t, verified=True)
    finally:
        sync.close()
    row["sent"] = sent
    return row


def sglang_names(sent: dict[str, torch.Tensor], hf: dict, family: Family) -> dict:
    """The SGLang parameters the sent tensors reach through megarl's layout, against every parameter the layout says
    a TP=1 server holds (the CPU smoke's check of the conversion to SGLang's names)."""
    from megarl.reshard.inventory import hf_inventory
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for

    if family.deep:
        return dict(sglang_params="not modelled (stacked experts: the deep check)")
    layout = layout_for(hf_inventory(hf), "sglang", 1, hf=hf, sglang_args=family.sglang_args)
    expected = ExpectedChecksums(layout, [0])
    for name, tensor in sent.items():
        expected.add(name, tensor)
    reached = {param for _, param in expected.result()}
    held = set(layout.parameters(0))
    return dict(sglang_params=len(held), sglang_reached=len(reached & held),
                sglang_missing=sorted(held - reached)[:8], sglang_unknown=sorted(reached - held)[:8])


def run_family(args, name: str, family: Family, seed: int) -> dict:
    from safetensors.torch import load_file

    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
    from megarl.engine import MegatronEngine
    from megarl.rollout.base import SamplingParams

    row: dict = dict(family=name)
    directory = Path(tempfile.mkdtemp(prefix=f"family-{name}-", dir=args.work_dir))
    rollout, engine = None, None
    try:
        t = time.perf_counter()
        hf = build(family, directory, seed)
        row |= dict(architecture=hf["architectures"][0], build_s=time.perf_counter() - t,
                    params=sum(v.numel() for v in load_file(directory / "model.safetensors").values()))
        t = time.perf_counter()
        rollout = rollout_engine(args, directory, family)
        row["startup_s"] = time.perf_counter() - t
        t = time.perf_counter()
        actor = ActorConfig(parallel=ParallelConfig(world_size=1), micro_batch_size=args.prompts,
                            optim=OptimConfig(lr=args.lr, clip_grad=0.0))
        engine = MegatronEngine(str(directory), actor, AlgorithmConfig(), args.device, seed, 10)
        row |= dict(megatron_s=time.perf_counter() - t, attention=engine.core_attention)
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, VOCAB, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        before = rollout.generate(prompts, greedy)
        row["generate_s"] = time.perf_counter() - t
        initial, served = score(engine, prompts, before)
        row["loaded"] = gap(initial, served)

        rollout.release_memory()  # colocated: SGLang's weights and KV cache go while megatron trains
        t = time.perf_counter()
        metrics = engine.train(sft_batch(prompts, args.new_tokens, seed), loss="sft", lr=args.lr)
        row |= dict(train_s=time.perf_counter() - t, train_loss=metrics.get("loss"))
        trained, _ = score(engine, prompts, before)
        row["moved"] = (trained - initial).abs().mean().item()

        row |= sync_and_verify(args, engine, rollout, hf, family)
        sent = row.pop("sent")
        checkpoint = load_file(directory / "model.safetensors")
        row["changed"] = f"{sum(not torch.equal(t.to(checkpoint[n].dtype), checkpoint[n]) for n, t in sent.items() if n in checkpoint)}/{len(sent)}"
        if args.device == "cpu":
            row |= sglang_names(sent, hf, family)
        after = rollout.generate(prompts, greedy)
        row["synced"] = gap(*score(engine, prompts, after))
        mean = row["synced"]["mean_abs_diff"]
        names_ok = not row.get("sglang_missing") and not row.get("sglang_unknown")
        row["passed"] = bool(row["verified"] and mean < args.max_gap and names_ok)
    except BaseException as error:  # the budget's alarm included: the family fails, the run goes on
        row |= dict(passed=False, error=repr(error)[:500], trace=traceback.format_exc()[-3000:])
        if hasattr(rollout, "servers"):
            row["server_log"] = rollout.servers[0].log_tail(40)
        if isinstance(error, KeyboardInterrupt):
            raise
    finally:
        if rollout is not None:
            rollout.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return row


class OutOfBudget(Exception):
    pass


def _alarm(signum, frame):
    raise OutOfBudget("the run's time budget ran out during this family")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON written after every family")
    parser.add_argument("--table", help="the markdown table's file (also printed)")
    parser.add_argument("--families", nargs="*", default=None, help="default: all, in their order")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds from the start for every family; a "
                                                                    "family starting with less than --min-family-s "
                                                                    "left is skipped, one running past it fails")
    parser.add_argument("--deadline", type=float, default=None, help="the budget's end as a Unix time instead (a "
                                                                      "caller's own clock, imports included)")
    parser.add_argument("--min-family-s", type=float, default=60)
    parser.add_argument("--log-dir", default=None, help="the SGLang servers' logs")
    parser.add_argument("--work-dir", default=None, help="the checkpoints (default: the system's temporary directory)")
    parser.add_argument("--mem-fraction", type=float, default=0.35, help="SGLang's static memory share (colocated)")
    parser.add_argument("--cuda-graph", action="store_true", help="capture SGLang's decode CUDA graphs (slower starts)")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4, help="the training step's (Adam: each weight moves ~lr)")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--max-gap", type=float, default=None,
                        help="the largest mean |log-prob diff| that passes (default 0.1 on cuda, bf16 on both sides; "
                             "1e-4 on cpu, fp32)")
    args = parser.parse_args()
    start = time.time()
    deadline = args.deadline or start + args.budget_s
    args.max_gap = args.max_gap if args.max_gap is not None else (0.1 if args.device == "cuda" else 1e-4)
    known = families()
    names = args.families or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {' '.join(known)}")
    if args.device == "cpu":
        torch.set_num_threads(2)
    init_megatron(args.device)
    result = dict(device=args.device, gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  settings={k: v for k, v in vars(args).items() if k not in ("out", "table")}, families=[])
    signal.signal(signal.SIGALRM, _alarm)
    for seed, name in enumerate(names):
        left = deadline - time.time()
        if left < args.min_family_s:
            result["families"].append(dict(family=name, skipped=f"{max(left, 0):.0f} s of the budget left"))
            continue
        signal.alarm(int(left))
        t = time.perf_counter()
        try:
            row = run_family(args, name, known[name], seed)
        finally:
            signal.alarm(0)
        row["family_s"] = time.perf_counter() - t
        result["families"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "server_log")}, default=str), flush=True)
    result["total_s"] = time.time() - start
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    text = table(result)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    raise SystemExit(0 if all(r.get("passed") for r in result["families"]) else 1)


def table(result: dict) -> str:
    f = lambda v, p=3: f"{v:.{p}f}" if isinstance(v, float) else ("" if v is None else str(v))
    rollout = "SGLang" if result["device"] == "cuda" else "transformers (megarl's hf engine)"
    lines = [f"families on {result['gpu']}: Megatron against {rollout}, {result.get('total_s', 0):.0f} s",
             "", "| family | params | server start s | sync s | verified | changed | loaded diff | moved | "
             "logprob_abs_diff (max) | k3 KL | pass |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["families"]:
        if "skipped" in r:
            lines.append(f"| {r['family']} | skipped: {r['skipped']} | | | | | | | | | no |")
            continue
        synced, loaded = r.get("synced", {}), r.get("loaded", {})
        verified = "yes" if r.get("verified") else "no"
        if r.get("verification"):
            verified += f" ({r['verification']})"
        lines.append(f"| {r['family']} | {r.get('params', 0) / 1e6:.1f}M | {f(r.get('startup_s'), 1)} | "
                     f"{f(r.get('sync_s'))} | {verified} | {r.get('changed', '')} | "
                     f"{f(loaded.get('mean_abs_diff'), 4)} | {f(r.get('moved'), 4)} | "
                     f"{f(synced.get('mean_abs_diff'), 4)} ({f(synced.get('max_abs_diff'), 3)}) | "
                     f"{f(synced.get('k3_kl'), 5)} | {'yes' if r.get('passed') else 'no'} |")
    for r in result["families"]:
        if r.get("error"):
            lines.append(f"\n{r['family']}: {r['error']}")
        if r.get("sglang_params") is not None:
            lines.append(f"{r['family']}: SGLang names: {r.get('sglang_reached', '-')} of {r['sglang_params']} "
                         f"parameters reached; missing {r.get('sglang_missing', [])}; unknown {r.get('sglang_unknown', [])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

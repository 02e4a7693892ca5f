"""DeepSeek-V3-shaped policies delivered into a real SGLang server and verified where SGLang holds them (one GPU,
no megatron: the sender's tensors are a checkpoint's HF tensors, put on the GPU as a training rank holds them).

Parts (each writes its JSON to --out as it goes):
  check  Two random checkpoints A and B of one DeepSeek-V3 shape (MLA with DeepSeek-V3's own attention dimensions,
         YaRN, routed experts with group-limited top-k and a routing bias, one shared expert, dense first layers),
         built offline by transformers with weights scaled for peaked next-token distributions. SGLang serves A
         (CUDA graphs on, as in training); then, each step verified by checksums of every parameter and derived
         tensor inside SGLang's TP worker against the sender's (megarl.rollout.weight_layout):
           loaded  - SGLang's own load of A from disk;
           logprob - SGLang's log-probs of its own samples against transformers' (fp32) on A's weights;
           sync    - B, A, B through megarl's push_policy in each CUDA IPC format ("persistent": megarl's loader,
                     "flattened_bucket" and "tensors": SGLang's own), every sync changing kv_b_proj, so the checks
                     of w_kc/w_vc show SGLang rederives them on every update through either loader; then the
                     log-prob gap against transformers on B (graph replays read the rederived tensors);
           flip    - a bit flipped in a derived tensor (w_kc) inside SGLang must be named, and pass once flipped back;
           split   - A's tensors sent with a bucket boundary between a layer's q_a_proj and kv_a_proj_with_mqa, past
                     keep_fused_pairs ("tensors" format: SGLang's own loader, one load per bucket): SGLang drops both
                     halves silently and verification names the fused parameter; the same buckets through
                     push_policy (keep_fused_pairs, "persistent") verify clean.
  sync   Sync time and GB/s of DeepSeek-V3-shaped models of --sync-layers layers (SGLang --load-format dummy, HF
         tensors on the GPU in --bucket-mb buckets, "persistent" format, weights resident): the best of --trials
         syncs, and one verified by checksums (sender, SGLang, comparison).

    python benchmarks/deepseek_sglang.py check --out check.json --log-dir /tmp/logs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megarl.utils.bucketing import buckets_by_size

# DeepSeek-V3's own attention dimensions (the triton MLA decode kernel of SGLang 0.5.17 needs them; shrunk ones
# failed to compile: ../shared/notes/sglang-deepseek.md) and MoE routing; width, depth and experts shrunk.
DEEPSEEK_V3_ATTENTION = dict(q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                             v_head_dim=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# what SGLang's DeepSeek model reads that transformers' DeepseekV3Config does not write (the published
# DeepSeek-V3 config.json carries them): ../shared/notes/sglang-deepseek.md
SGLANG_FIELDS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1,
                     num_nextn_predict_layers=0)


def deepseek_config(layers: int = 4, hidden: int = 1024, heads: int = 16, experts: int = 16, vocab: int = 32000,
                    moe_intermediate: int = 512, intermediate: int = 2816, dense: int = 1, q_lora: int = 768) -> dict:
    """config.json of a DeepSeek-V3 shape: top-4 of `experts` routed experts in 4 groups, top-2 groups, one shared;
    MLA with DeepSeek-V3's own head dimensions and kv_lora_rank, q_lora_rank `q_lora` (DeepSeek-V3: 1536)."""
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=vocab,
                hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=moe_intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1,
                n_routed_experts=experts, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                norm_topk_prob=True, first_k_dense_replace=dense, max_position_embeddings=4096, rms_norm_eps=1e-6,
                hidden_act="silu", tie_word_embeddings=False, rope_parameters=dict(YARN), torch_dtype="bfloat16",
                bos_token_id=0, eos_token_id=1, **(DEEPSEEK_V3_ATTENTION | dict(q_lora_rank=q_lora)),
                **SGLANG_FIELDS)


def build_checkpoint(hf: dict, directory: Path, seed: int, output_scale: float = 4.0) -> Path:
    """A random bf16 checkpoint by transformers: norms 1 + 0.1 N(0,1), the routing bias 0.1 N(0,1), every matrix
    N(0, 1/fan_in) (unit-scale activations through the layers), the output layer `output_scale` times that (4:
    peaked next-token distributions, so a wrong weight moves log-probs visibly)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{k: v for k, v in hf.items()
                                 if k not in SGLANG_FIELDS and k not in ("torch_dtype", "model_type")})
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (output_scale if "lm_head" in name else 1) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.to(torch.bfloat16).save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(json.loads((directory / "config.json").read_text())
                                                      | SGLANG_FIELDS, indent=1))
    return directory


def build_policy_dir(directory: Path, layers: int, hidden: int, heads: int, experts: int, moe_intermediate: int,
                     intermediate: int, dense: int, seed: int = 0) -> Path:
    """A DeepSeek-V3-shaped policy for megarl.train (model.path): build_checkpoint's weights with megarl's
    character tokenizer (pad 0, eos 1), the vocabulary padded to 128 rows (a multiple of 64, as SGLang pads it),
    the output layer unscaled (a trainable start: next-token losses near log(vocab))."""
    from megarl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    hf = deepseek_config(layers=layers, hidden=hidden, heads=heads, experts=experts, vocab=128,
                         moe_intermediate=moe_intermediate, intermediate=intermediate, dense=dense)
    hf |= dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    build_checkpoint(hf, Path(directory), seed, output_scale=1.0)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def checkpoint_tensors(directory: Path, device: str = "cuda") -> dict[str, torch.Tensor]:
    """The checkpoint's HF tensors on the GPU, in megarl's inventory order (the order its buckets come in)."""
    from safetensors.torch import load_file

    from megarl.reshard.inventory import hf_inventory

    loaded = load_file(str(directory / "model.safetensors"), device=device)
    names = [s.name for s in hf_inventory(json.loads((directory / "config.json").read_text()))]
    missing = set(names) ^ set(loaded)
    if missing:
        raise ValueError(f"checkpoint {directory} and megarl's inventory differ in {sorted(missing)[:6]}")
    return {n: loaded[n] for n in names}


def buckets_of(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list]:
    return list(buckets_by_size((((name, t), t.numel() * t.element_size()) for name, t in tensors.items()),
                                bucket_bytes))


class Verifier:
    """Checksums of what SGLang holds against what was sent: every step's result, failures included."""

    def __init__(self, engine, hf: dict):
        from megarl.reshard.inventory import hf_inventory
        from megarl.rollout.weight_layout import layout_for

        self.engine, self.layout = engine, layout_for(hf_inventory(hf), "sglang", engine.servers[0].tp, hf=hf)

    def expected(self):
        from megarl.rollout.weight_layout import ExpectedChecksums

        return ExpectedChecksums(self.layout, list(range(self.layout.tp)))

    def of(self, tensors: dict[str, torch.Tensor]) -> dict:
        expected = self.expected()
        for name, t in tensors.items():
            expected.add(name, t)
        return expected.result()

    def check(self, expected: dict) -> dict:
        """{"ok", "error", "checked", "derived", "seconds"} of one verification (SGLang's checksums and compare)."""
        from megarl.workers.sync_checks import WeightSyncError
        from megarl.workers.weight_sync import verify_checksums

        t = time.perf_counter()
        held = self.engine.weight_checksums()
        names = [n for ranks in held.values() for params in ranks.values() for n in params]
        row = dict(checked=len(names), derived=sum(n.endswith((".w_kc", ".w_vc")) for n in names),
                   fp32=sorted({n.rsplit(".", 1)[-1] for ranks in held.values() for params in ranks.values()
                                for n, v in params.items() if v[0] == "torch.float32"}))
        try:
            verify_checksums(expected, held)
            row |= dict(ok=True, error=None)
        except WeightSyncError as error:
            row |= dict(ok=False, error=str(error))
        row["seconds"] = time.perf_counter() - t
        return row


def push(engine, buckets, fmt: str, expected, syncs: dict) -> dict:
    """One sync through megarl's weight_sync.PolicySync, as a training rank runs it; `expected`: an ExpectedChecksums
    to fill (a verified sync), or None. `syncs`: per format, the PolicySync kept across syncs (one per format)."""
    from megarl.workers.weight_sync import PolicySync, RolloutSide

    torch.cuda.synchronize()
    sync = syncs.setdefault(fmt, PolicySync(fmt))
    report = sync.push(buckets, RolloutSide.of_engine(engine), expected is not None, expected=expected)
    return dict(sync_s=report.seconds, bytes=report.bytes, gb_per_s=report.bytes / report.seconds / 1e9,
                sender_checksum_s=report.digest_s, expected=report.expected)


def close(syncs: dict) -> None:
    for sync in syncs.values():
        sync.close()


def logprob_gap(engine, directory: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """SGLang samples (temperature 1) with log-probs; transformers (eager, on the GPU) scores the same tokens in fp32
    and in bf16. transformers' own bf16-vs-fp32 gap is the noise floor of SGLang's bf16 serving against fp32."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.base import SamplingParams

    engine.resume_kv_cache()
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True,
                                                          seed=0))
    sglang = torch.cat([torch.tensor(g.logprobs) for g in generations])
    scored = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager").cuda()
        out = []
        with torch.no_grad():
            for g in generations:
                prompt = prompts[g.prompt_index]
                ids = torch.tensor([prompt + g.token_ids], device="cuda")
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
                out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu())
        scored[dtype] = torch.cat(out)
        del model
        torch.cuda.empty_cache()
    gap = (scored[torch.float32] - sglang).abs()
    floor = (scored[torch.float32] - scored[torch.bfloat16]).abs()
    return dict(tokens=gap.numel(), mean_abs_diff=gap.mean().item(), max_abs_diff=gap.max().item(),
                hf_bf16_mean_abs_diff=floor.mean().item(), hf_bf16_max_abs_diff=floor.max().item(),
                sglang_vs_hf_bf16_mean_abs_diff=(scored[torch.bfloat16] - sglang).abs().mean().item(),
                mean_logprob=sglang.mean().item())


def part_check(args) -> dict:
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.sglang_server import sglang_server
    from megarl.rollout.transports import cuda_ipc

    hf = deepseek_config(layers=args.layers)
    root = Path(tempfile.mkdtemp(prefix="deepseek-"))
    t = time.perf_counter()
    a = build_checkpoint(hf, root / "a", seed=0)
    b = build_checkpoint(hf, root / "b", seed=1)
    result = dict(config=hf, params=sum(v.numel() for v in checkpoint_tensors(a, "cpu").values()),
                  build_s=time.perf_counter() - t)
    server = sglang_server(str(a), tp=1, mem_fraction=args.mem_fraction, log_dir=args.log_dir,
                           startup_timeout=args.startup_timeout, request_timeout=300)
    try:
        t = time.perf_counter()
        engine = SGLangRolloutEngine(str(a), tp=1, colocated=True, launch=lambda i: server)
        result["startup_s"] = time.perf_counter() - t
        verifier = Verifier(engine, hf)
        tensors = {"a": checkpoint_tensors(a), "b": checkpoint_tensors(b)}
        expected = {k: verifier.of(v) for k, v in tensors.items()}
        result["loaded"] = verifier.check(expected["a"])
        _write(args, result)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, hf["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        result["logprob_a"] = logprob_gap(engine, a, prompts, args.new_tokens)
        _write(args, result)
        result["sync"], senders = [], {}
        for which, fmt in (("b", "persistent"), ("a", "flattened_bucket"), ("b", "tensors")):
            row = push(engine, buckets_of(tensors[which], args.bucket_mb << 20), fmt, verifier.expected(), senders)
            sent = row.pop("expected")
            row |= dict(weights=which, format=fmt, sent_equals_file=sent == expected[which], **verifier.check(sent))
            result["sync"].append(row)
            _write(args, result)
        result["logprob_b"] = logprob_gap(engine, b, prompts, args.new_tokens)
        _write(args, result)

        flipped = "model.layers.1.self_attn.w_kc"
        engine.corrupt_weight(flipped)
        caught = verifier.check(expected["b"])
        engine.corrupt_weight(flipped)  # and back
        result["flip"] = dict(tensor=flipped, named=bool(caught["error"]) and flipped in caught["error"],
                              error=caught["error"], after_flip_back=verifier.check(expected["b"])["ok"])
        _write(args, result)

        names = list(tensors["a"])
        cut = names.index("model.layers.1.self_attn.q_a_proj.weight") + 1
        split = [list(tensors["a"].items())[:cut], list(tensors["a"].items())[cut:]]
        endpoints = engine.begin_weight_update()
        sender = cuda_ipc.CudaIpcSender(endpoints, "tensors")  # SGLang's own loader, one load per bucket
        for bucket in split:  # past keep_fused_pairs: the boundary reaches SGLang
            sender.send(bucket)()
        engine.end_weight_update()
        lone = verifier.check(expected["a"])
        kept = push(engine, split, "persistent", verifier.expected(), senders)
        kept.pop("expected")
        result["split"] = dict(boundary_after=names[cut - 1], without_keep=lone,
                               fused_named=bool(lone["error"]) and "fused_qkv_a_proj_with_mqa" in lone["error"],
                               with_keep=kept | verifier.check(expected["a"]))
        close(senders)
    except Exception as error:
        result |= dict(error=repr(error), trace=traceback.format_exc()[-3000:], server_log=server.log_tail(40))
    finally:
        server.shutdown()
    _write(args, result)
    return result


def part_sync(args) -> dict:
    from megarl.reshard.inventory import hf_inventory
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.sglang_server import sglang_server

    rows = []
    for layers in args.sync_layers:
        hf = deepseek_config(layers=layers, hidden=args.sync_hidden, heads=args.sync_heads, experts=args.sync_experts,
                             vocab=129280, moe_intermediate=args.sync_moe_intermediate,
                             intermediate=args.sync_intermediate, dense=min(3, layers), q_lora=1536)
        directory = Path(tempfile.mkdtemp(prefix="deepseek-sync-"))
        (directory / "config.json").write_text(json.dumps(hf))
        server = sglang_server(str(directory), tp=1, mem_fraction=args.sync_mem_fraction, log_dir=args.log_dir,
                               startup_timeout=args.startup_timeout, request_timeout=600, load_format="dummy",
                               cuda_graph=False, extra_args=("--skip-server-warmup",))
        row = dict(layers=layers, config=hf)
        try:
            engine = SGLangRolloutEngine(str(directory), tp=1, colocated=True, launch=lambda i: server)
            g = torch.Generator(device="cuda").manual_seed(0)
            tensors = {s.name: (torch.randn(s.shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                       for s in hf_inventory(hf)}
            row["params"] = sum(t.numel() for t in tensors.values())
            verifier, senders = Verifier(engine, hf), {}
            trials = []
            for _ in range(args.trials + 1):  # the first warms up the IPC and loader paths
                trials.append(push(engine, buckets_of(tensors, args.bucket_mb << 20), "persistent", None, senders))
            best = min(trials[1:], key=lambda r: r["sync_s"])
            best.pop("expected", None)
            checked = push(engine, buckets_of(tensors, args.bucket_mb << 20), "persistent", verifier.expected(), senders)
            verification = verifier.check(checked.pop("expected"))
            row |= dict(best, trials_s=[r["sync_s"] for r in trials[1:]], checksum_sync_s=checked["sync_s"],
                        sender_checksum_s=checked["sender_checksum_s"], verify_s=verification["seconds"],
                        verified=verification["ok"], verify_error=verification["error"],
                        checked=verification["checked"], derived=verification["derived"],
                        gpu_memory_gb=torch.cuda.max_memory_allocated() / 1e9)
            close(senders)
            del tensors
        except Exception as error:
            row |= dict(error=repr(error), trace=traceback.format_exc()[-3000:], server_log=server.log_tail(40))
        finally:
            server.shutdown()
            torch.cuda.empty_cache()
        rows.append(row)
        _write(args, {"sync": rows})
        print(json.dumps({k: v for k, v in row.items() if k not in ("config", "trace")}), flush=True)
    return {"sync": rows}


def _write(args, result) -> None:
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))


def part_build(args) -> dict:
    directory = build_policy_dir(Path(args.model_dir), args.layers, args.hidden, args.heads, args.experts,
                                 args.moe_intermediate, args.intermediate, args.dense)
    hf = json.loads((directory / "config.json").read_text())
    from megarl.reshard.inventory import hf_inventory

    result = dict(model_dir=str(directory), params=sum(s.numel for s in hf_inventory(hf)), config=hf)
    _write(args, result)
    return result


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def part_table(args) -> dict:
    """deepseek.sh's short table, from the JSON and metrics files in --results (what exists of them)."""
    out, lines = Path(args.results), []
    f = lambda v, p=3: f"{v:.{p}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
    check = _load(out / "sglang_check.json")
    if check:
        lines.append(f"sglang check ({check.get('params', 0) / 1e6:.0f}M params, start-up {f(check.get('startup_s'), 0)} s)"
                     + (f": ERROR {check['error'][:300]}" if check.get("error") else ""))
        lines += ["", "| step | weights / format | sync s (GB/s) | verified | checked (derived w_kc/w_vc) | fp32 held |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, row in [("loaded from disk", check.get("loaded"))] + [("sync", r) for r in check.get("sync", [])]:
            if row:
                sync = f"{f(row['sync_s'])} ({f(row['gb_per_s'], 2)})" if "sync_s" in row else ""
                lines.append(f"| {name} | {row.get('weights', 'a')} / {row.get('format', 'disk')} | {sync} | "
                             f"{row['ok']}{'' if row['ok'] else ' ' + str(row['error'])[:200]} | {row['checked']} "
                             f"({row['derived']}) | {','.join(row.get('fp32', []))} |")
        for key in ("logprob_a", "logprob_b"):
            if check.get(key):
                r = check[key]
                lines.append(f"log-prob |SGLang - transformers fp32| on {key[-1].upper()}'s weights: mean "
                             f"{f(r['mean_abs_diff'], 4)}, max {f(r['max_abs_diff'], 4)} over {r['tokens']} tokens "
                             f"(mean log-prob {f(r['mean_logprob'], 2)}); transformers bf16 vs fp32 (the noise "
                             f"floor): mean {f(r.get('hf_bf16_mean_abs_diff'), 4)}, max {f(r.get('hf_bf16_max_abs_diff'), 4)}"
                             f"; SGLang vs transformers bf16: mean {f(r.get('sglang_vs_hf_bf16_mean_abs_diff'), 4)}")
        if check.get("flip"):
            lines.append(f"bit flipped in {check['flip']['tensor']}: named {check['flip']['named']}, "
                         f"clean after flipping back {check['flip']['after_flip_back']}")
        if check.get("split"):
            r = check["split"]
            lines.append(f"boundary after {r['boundary_after']}: without keep_fused_pairs the fused parameter named "
                         f"{r['fused_named']} ({str(r['without_keep']['error'])[:160]}); through push_policy verified "
                         f"{r['with_keep']['ok']}")
    transport = _load(out / "transport.json")
    if transport:
        lines += ["", "| transport: layers | params | sync s (GB/s) | trials s | sync + sender checksums s | SGLang "
                      "checksums + compare s | verified (checked, derived) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in transport.get("sync", []):
            if "error" in r:
                lines.append(f"| {r['layers']} | ERROR {r['error'][:200]} |")
                continue
            lines.append(f"| {r['layers']} | {r['params'] / 1e9:.2f}B | {f(r['sync_s'])} ({f(r['gb_per_s'], 1)}) | "
                         f"{[round(x, 3) for x in r['trials_s']]} | {f(r['checksum_sync_s'])} | {f(r['verify_s'])} | "
                         f"{r['verified']} ({r['checked']}, {r['derived']}) |")
    for name in ("grpo", "sync"):
        model = _load(out / f"{name}_model.json")
        path = out / f"{name}_metrics.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        lines += ["", f"{name}: {model['params'] / 1e9:.2f}B parameters" if model else name,
                  "| step | train/reward | val/reward | logprob_abs_diff | sync s (GB/s) | verified | verify s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            if "train/reward" in r or "sync/seconds" in r:
                lines.append(f"| {r.get('step')} | {f(r.get('train/reward', ''))} | {f(r.get('val/reward', ''))} | "
                             f"{f(r.get('rollout/logprob_abs_diff', ''), 4)} | {f(r.get('sync/seconds', ''))} "
                             f"({f(r.get('sync/gb_per_s', ''), 2)}) | {r.get('sync/verified', '')} | "
                             f"{f(r.get('sync/verify_s', ''))} |")
    optimizer = {k: _load(out / f"optimizer_{k}.json") for k in ("false", "true")}
    if any(optimizer.values()):
        lines += ["", "| optimizer | losses | peak GPU GB (measured) | planner's peak GB | step s |",
                  "| --- | --- | --- | --- | --- |"]
        for k, r in optimizer.items():
            if r:
                lines.append(f"| {'CPU (offload)' if k == 'true' else 'GPU'} | {[round(x, 5) for x in r.get('losses', [])]} "
                             f"| {f(r.get('peak_gb'), 2)} | {f(r.get('predicted_gb'), 2)} | {f(r.get('step_s'), 2)} |"
                             + (f" ERROR {r['error'][:200]}" if r.get("error") else ""))
        if all(optimizer.values()) and "peak_gb" in optimizer["true"] and "peak_gb" in optimizer["false"]:
            on, off = optimizer["true"], optimizer["false"]
            lines.append(f"losses equal: {on['losses'] == off['losses']} (max |diff| "
                         f"{max((abs(a - b) for a, b in zip(on['losses'], off['losses'])), default=float('nan')):.2e}); "
                         f"peak drop {off['peak_gb'] - on['peak_gb']:.2f} GB measured, "
                         f"{off.get('predicted_gb', float('nan')) - on.get('predicted_gb', float('nan')):.2f} GB predicted")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("check", "sync", "build", "table"))
    parser.add_argument("--results", help="table: the directory of deepseek.sh's results")
    parser.add_argument("--out", required=True)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--layers", type=int, default=4, help="check, build: decoder layers")
    parser.add_argument("--model-dir", help="build: the policy's directory (checkpoint, char tokenizer)")
    parser.add_argument("--hidden", type=int, default=1024, help="build")
    parser.add_argument("--heads", type=int, default=16, help="build")
    parser.add_argument("--experts", type=int, default=16, help="build: routed experts")
    parser.add_argument("--moe-intermediate", type=int, default=512, help="build")
    parser.add_argument("--intermediate", type=int, default=2816, help="build: the dense layers' FFN width")
    parser.add_argument("--dense", type=int, default=1, help="build: dense first layers")
    parser.add_argument("--mem-fraction", type=float, default=0.4)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--sync-layers", type=int, nargs="+", default=[8])
    parser.add_argument("--sync-hidden", type=int, default=7168)
    parser.add_argument("--sync-heads", type=int, default=128)
    parser.add_argument("--sync-experts", type=int, default=32)
    parser.add_argument("--sync-moe-intermediate", type=int, default=2048)
    parser.add_argument("--sync-intermediate", type=int, default=18432)
    parser.add_argument("--sync-mem-fraction", type=float, default=0.45)
    args = parser.parse_args()
    result = {"check": part_check, "sync": part_sync, "build": part_build, "table": part_table}[args.part](args)
    if "error" in result:
        print(result["error"], result.get("trace", ""), result.get("server_log", ""), sep="\n", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

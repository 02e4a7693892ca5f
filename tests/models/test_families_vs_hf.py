"""Every model family on megatron against transformers on the same checkpoint, in one 2-rank gloo job
that changes layout in place: TP=2, PP=2, DP=2, (for Qwen3-MoE) EP=2 with DP=2, and TP=2 with sequence
parallelism (SP; Qwen3 and Qwen3-MoE); and Qwen3-MoE at EP=2 x TP=2 with SP, EP=2 x PP=2 and
EP=4 (one expert per rank, four data-parallel ranks whose rows differ in length: the engine makes
them agree on micro-batch shapes and counts for the expert token exchange) on 4 ranks; Llama 3, Qwen3-MoE, Mistral,
Mixtral and GLM-4.5 at CP=2, padded and packed (Qwen2's and Qwen3's CP: tests/engine/test_context_parallel.py).

Per family and layout: log-probs and entropy equal transformers' (float32, CPU), and the weights
exported back to HF names are bitwise the checkpoint's. Qwen3-MoE also takes one SFT Adam step at every
layout where megatron trains it (at TP > 1 only with SP); its loss, grad norm and updated weights equal a
single-process transformers + torch.optim.Adam step: the expert gradients survive megatron's DDP
(expert-DP reduction) and grad norm (EP reduction) intact, and under SP the norm and router gradients
(partial per TP rank) are summed over TP.
"""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.algorithms.losses import sft_loss
from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import (gemma3_config, glm4_moe_config, llama_config, mistral_config, mixtral_config, qwen3_config,
                                      qwen3_moe_config, save_random)

# (tp, pp, ep, sequence_parallel) on 2 ranks
LAYOUTS = ((1, 1, 1, False), (2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (2, 1, 1, True))
# On 4 ranks: experts split over EP and, within each EP rank, over TP; EP within each pipeline stage; EP over all.
EP_LAYOUTS_4 = ((2, 1, 2, True), (1, 2, 2, False), (1, 1, 4, False))
# the dense families also checked under SP (QK-norm: gradients summed over TP by name; Gemma 3's post-norms)
SP_DENSE = ("qwen3", "gemma3")
LR = 1e-2
CP_BUDGET = 24  # tokens per packed micro-batch at CP=2: two rows of padded_batch's longest (12)
# With the default eps (1e-8) Adam's first step is ~lr*sign(grad) and turns float noise in near-zero
# gradient entries (unhit expert rows) into differences of ~lr; eps=1e-2 keeps the step a smooth
# function of the gradient (|d step / d grad| <= lr/eps = 1), so the weights compare the gradients.
ADAM_EPS = 1e-2


def _relayout(tp, pp, ep, cp=1):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)


def _exported(engine) -> dict:
    return {name: t for bucket in engine.export_hf_weights(1 << 30) for name, t in bucket}


def assert_like_hf(engine, ref_logprobs, ref_entropy, model_dir, where: str) -> None:
    """The engine's log-probs and entropy on padded_batch() are transformers' (fp32), and its export is the
    checkpoint bitwise."""
    out = engine.compute_logprobs(padded_batch(), with_entropy=True)
    # fp32 sums in another order (TP's partial sums, another processor's kernels): a few ulps of a log-prob near -7
    # reach 1.2e-5, so the bound grows with the value; a wrong mapping is off by 1e-3 or more
    for key, ref in (("logprobs", ref_logprobs), ("entropy", ref_entropy)):
        torch.testing.assert_close(out[key], ref, rtol=4e-6, atol=1e-5, msg=lambda m: f"{where}: {key}: {m}")
    exported, checkpoint = _exported(engine), load_file(f"{model_dir}/model.safetensors")
    assert sorted(exported) == sorted(checkpoint), where
    for key, tensor in checkpoint.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (where, key)


def sft_step(model_dir, parallel, **actor) -> tuple[dict, dict]:
    """One SFT Adam step (LR, ADAM_EPS, no clipping) of a fresh engine on this rank's share of padded_batch(8), as
    _hf_sft_step takes on the whole batch: its metrics and exported weights."""
    from megatron.core import parallel_state as ps

    from megarl.engine import MegatronEngine

    config = ActorConfig(parallel=parallel, micro_batch_size=2, optim=OptimConfig(lr=LR, adam_eps=ADAM_EPS,
                                                                                  clip_grad=0.0), **actor)
    engine = MegatronEngine(model_dir, config, AlgorithmConfig(), "cpu", 1, 10)
    share = padded_batch(rows=8).chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    return engine.train(share, loss="sft"), _exported(engine)


def _check_rank(rank, cases, layouts, train_dir=None):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine

    trained = {}
    for tp, pp, ep, sp in layouts:
        _relayout(tp, pp, ep)
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep, sequence_parallel=sp)
        for name, model_dir, moe, ref_logprobs, ref_entropy in cases:
            if not moe and (ep > 1 or (sp and name not in SP_DENSE)):
                continue
            engine = MegatronEngine(model_dir, ActorConfig(parallel=parallel, micro_batch_size=2), AlgorithmConfig(),
                                    "cpu", 1, 10)
            assert engine.gpt.config.sequence_parallel == sp
            assert_like_hf(engine, ref_logprobs, ref_entropy, model_dir, f"{name} at tp={tp} pp={pp} ep={ep} sp={sp}")

        if train_dir is None or (tp > 1 and not sp):
            continue  # megatron refuses MoE training at TP > 1 without sequence parallelism
        trained[(tp, pp, ep, sp)] = sft_step(train_dir, parallel)
    return trained


def _hf_sft_step(model_dir, out_dir):
    """One SFT Adam step of transformers' model on the whole batch: loss, grad norm, saved weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = padded_batch(rows=8)
    logits = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["tokens"][:, 1:, None]).squeeze(-1)
    logprobs = torch.nn.functional.pad(torch.where(batch["attention_mask"][:, 1:] > 0, logp, 0.0), (1, 0))
    loss = sft_loss(logprobs, batch["loss_mask"], batch["loss_mask"].sum().item())
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())).item()
    torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS).step()
    model.save_pretrained(out_dir)  # in the checkpoint's own (per-expert) tensor names
    return loss.item(), grad_norm, load_file(f"{out_dir}/model.safetensors")


def test_every_family_matches_transformers_at_tp_pp_ep(tmp_path):
    configs = {"llama3-tied": llama_config(tied=True), "llama3": llama_config(tied=False),
               "qwen3-tied": qwen3_config(tied=True), "qwen3": qwen3_config(tied=False),
               "qwen3-moe": qwen3_moe_config(tied=False, norm_topk_prob=True),
               "qwen3-moe-tied-unnormed": qwen3_moe_config(tied=True, norm_topk_prob=False)}
    cases = []
    for seed, (name, config) in enumerate(configs.items()):
        model_dir = save_random(config, tmp_path / name, seed=seed)
        ref_logprobs, ref_entropy = hf_logprobs_entropy(model_dir, padded_batch())
        cases.append((name, model_dir, "moe" in name, ref_logprobs, ref_entropy))
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(cases[4][1], tmp_path / "hf-step")

    trained = run_distributed(_check_rank, 2, cases, LAYOUTS, cases[4][1], timeout=240)

    assert sorted(trained) == [(1, 1, 1, False), (1, 1, 2, False), (1, 2, 1, False), (2, 1, 1, True)]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)


def _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights):
    for layout, (metrics, weights) in trained.items():
        assert abs(metrics["loss"] - ref_loss) < 1e-5 * abs(ref_loss), layout
        assert abs(metrics["grad_norm"] - ref_grad_norm) < 1e-5 * ref_grad_norm, layout
        assert sorted(weights) == sorted(ref_weights)
        for key, tensor in ref_weights.items():
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-5, msg=f"{layout} {key}")


def test_qwen3_moe_with_ep_combined_with_tp_or_pp_and_ep4(tmp_path):
    model_dir = save_random(qwen3_moe_config(tied=False, norm_topk_prob=True), tmp_path / "moe", seed=7)
    cases = [("qwen3-moe", model_dir, True, *hf_logprobs_entropy(model_dir, padded_batch()))]
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(model_dir, tmp_path / "hf-step")

    trained = run_distributed(_check_rank, 4, cases, EP_LAYOUTS_4, model_dir, timeout=240)

    assert sorted(trained) == [(1, 1, 4, False), (1, 2, 2, False), (2, 1, 2, True)]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)


def test_mistral_and_mixtral_match_transformers_at_tp_pp_ep(tmp_path):
    """Mistral (an explicit head_dim, a sliding window as long as its positions) and Mixtral (block_sparse_moe's
    w1/w3/w2 experts, always-renormalised top 2 of 4) at TP=2, PP=2, DP=2 and, for Mixtral, EP=2 and TP=2 with SP:
    log-probs and entropy as transformers', the export bitwise the checkpoint's; Mixtral's SFT Adam step as
    transformers + torch.optim.Adam's at every layout megatron trains it in."""
    cases = []
    for seed, (name, config) in enumerate({"mistral": mistral_config(), "mixtral-moe": mixtral_config()}.items()):
        model_dir = save_random(config, tmp_path / name, seed=11 + seed)
        cases.append((name, model_dir, "moe" in name, *hf_logprobs_entropy(model_dir, padded_batch())))
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(cases[1][1], tmp_path / "hf-step")

    trained = run_distributed(_check_rank, 2, cases, LAYOUTS, cases[1][1], timeout=240)

    assert sorted(trained) == [(1, 1, 1, False), (1, 1, 2, False), (1, 2, 1, False), (2, 1, 1, True)]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)


def test_glm4_moe_matches_transformers_at_tp_pp_ep(tmp_path):
    """GLM-4.5 (q/k/v biases, QK-norm, RoPE on the first half of each head, a dense layer, then a MoE layer routed by
    sigmoid scores with a random routing bias over 2 groups, a shared expert, routed_scaling_factor 2.5) and
    GLM-4.5-Air's attention (biases, no QK-norm; one group of every expert) at TP=2, PP=2, DP=2, EP=2 and TP=2 with SP:
    log-probs and entropy as transformers', the export bitwise the checkpoint's (the float32 bias included); GLM-4.5's
    SFT Adam step as transformers + torch.optim.Adam's at every layout megatron trains it in."""
    configs = {"glm4.5-moe": glm4_moe_config(), "glm4.5-air-moe": glm4_moe_config(use_qk_norm=False, n_group=1,
                                                                                   topk_group=1)}
    cases = []
    for seed, (name, config) in enumerate(configs.items()):
        model_dir = save_random(config, tmp_path / name, seed=21 + seed)
        cases.append((name, model_dir, True, *hf_logprobs_entropy(model_dir, padded_batch())))
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(cases[0][1], tmp_path / "hf-step")

    trained = run_distributed(_check_rank, 2, cases, LAYOUTS, cases[0][1], timeout=240)

    assert sorted(trained) == [(1, 1, 1, False), (1, 1, 2, False), (1, 2, 1, False), (2, 1, 1, True)]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)


def test_gemma3_matches_transformers_at_tp_pp_sp(tmp_path):
    """Gemma 3 (local layers with a 4-token window shorter than the rows and RoPE base 1e4, global layers with linear
    RoPE scaling, four (1 + weight) norms per layer, QK-norm, query_pre_attn_scalar, the scaled tied embedding, gelu)
    at TP=2, PP=2 and TP=2 with SP: log-probs and entropy as transformers', the export bitwise the checkpoint's; its
    SFT Adam step as transformers + torch.optim.Adam's at PP=2 and at TP=2 with SP (the post-norms' partial gradients
    summed over TP)."""
    model_dir = save_random(gemma3_config(), tmp_path / "gemma3", seed=31)
    cases = [("gemma3", model_dir, False, *hf_logprobs_entropy(model_dir, padded_batch()))]
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(model_dir, tmp_path / "hf-step")

    layouts = ((2, 1, 1, False), (1, 2, 1, False), (2, 1, 1, True))
    trained = run_distributed(_check_rank, 2, cases, layouts, model_dir, timeout=240)

    assert sorted(trained) == [(1, 2, 1, False), (2, 1, 1, True)]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)


def _cp_rank(rank, cases, train_dirs):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine

    _relayout(1, 1, 1, cp=2)
    parallel = ParallelConfig(world_size=dist.get_world_size(), cp=2)
    for max_tokens in (0, CP_BUDGET):
        actor = ActorConfig(parallel=parallel, micro_batch_size=2, max_tokens_per_micro_batch=max_tokens)
        for name, model_dir, ref_logprobs, ref_entropy in cases:
            engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10, trainable=False)
            assert engine.core_attention == "sdpa" and engine.gpt.config.context_parallel_size == 2
            assert_like_hf(engine, ref_logprobs, ref_entropy, model_dir, f"{name} at cp=2 max_tokens={max_tokens}")
    return {name: sft_step(model_dir, parallel) for name, model_dir in train_dirs.items()}


def test_families_match_transformers_at_cp2(tmp_path):
    """Context parallelism (CP=2 on 2 ranks, each rank a head and a tail quarter of every row) for Llama 3 (llama3
    RoPE scaling), Qwen3-MoE, Mistral (a sliding window as long as its positions: full attention), Mixtral and GLM-4.5
    (partial RoPE, sigmoid group routing with its bias, a shared expert), each CP rank routing its own tokens, on
    padded rows and on rows packed up to CP_BUDGET tokens: log-probs and entropy as transformers', the export bitwise
    the checkpoint's. Mixtral's and GLM-4.5's SFT Adam step at CP=2 as transformers + torch.optim.Adam's (the CP
    ranks' expert and router gradients sum to the whole rows')."""
    configs = {"llama3": llama_config(tied=False), "qwen3-moe": qwen3_moe_config(tied=False, norm_topk_prob=True),
               "mistral": mistral_config(), "mixtral-moe": mixtral_config(), "glm4.5-moe": glm4_moe_config()}
    cases = []
    for seed, (name, config) in enumerate(configs.items()):
        model_dir = save_random(config, tmp_path / name, seed=41 + seed)
        cases.append((name, model_dir, *hf_logprobs_entropy(model_dir, padded_batch())))
    train_dirs = {name: model_dir for name, model_dir, *_ in cases if name in ("mixtral-moe", "glm4.5-moe")}
    refs = {name: _hf_sft_step(model_dir, tmp_path / f"{name}-hf-step") for name, model_dir in train_dirs.items()}

    trained = run_distributed(_cp_rank, 2, cases, train_dirs, timeout=240)

    assert sorted(trained) == sorted(train_dirs)
    for name, step in trained.items():
        _assert_like_hf_step({f"{name} at cp=2": step}, *refs[name])

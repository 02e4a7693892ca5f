"""The planner: published parameter totals, hand-computed traffic and memory, uneven stages, EP/ETP, optimizer
offload, the layouts that fit, agreement with recorded GPU peaks, the CLI and its errors."""

import contextlib
import functools
import io
import json
from pathlib import Path

import pytest

from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import GenLayout, TrainLayout
from megarl.reshard.memory import GiB, MemorySettings, predict_peak, rank_memory, stage_params
from megarl.parallel.stages import default_first_last, stage_layers
from megarl.reshard.plan import (fitting_layouts, generation_layouts, kv_bytes_per_token, load_model_config, main,
                                 parse_layout, plan, train_layout)

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"

# The layout search of DeepSeek-V3 over 128 GPUs (~5-10 s on 2 cores): its output serves two tests.
DEEPSEEK_128_GPUS = ("--model", "deepseek-v3", "--gpus", "128", "--gpu-mem", "130", "--optimizer-offload", "--recompute",
                     "full", "--top", "6")


@functools.cache
def cli_output(*argv: str) -> str:
    """What `python -m megarl.plan *argv` prints (main() in this process), computed once per argv."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        main(list(argv))
    return out.getvalue()


@pytest.mark.parametrize("name,billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.544), ("qwen2.5-3b", 3.086),
                                           ("qwen2.5-7b", 7.616), ("qwen2.5-72b", 72.71), ("qwen3-30b-a3b", 30.53),
                                           ("qwen3-235b-a22b", 235.09), ("deepseek-v3", 671.03),
                                           ("mistral-7b-v0.3", 7.248), ("mistral-nemo-12b", 12.248),
                                           ("mixtral-8x7b", 46.70), ("glm-4.5", 352.80), ("glm-4.5-air", 106.85),
                                           ("qwen3-vl-8b", 8.767), ("qwen3-vl-30b-a3b", 31.07),
                                           ("qwen3-next-80b-a3b", 79.67),
                                           ("qwen3.5-397b-a17b", 396.35), ("kimi-k2", 1026.4),
                                           ("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)])
def test_parameter_totals_match_the_published_sizes(name, billions):
    total = sum(s.numel for s in hf_inventory(load_model_config(name)))
    assert total / 1e9 == pytest.approx(billions, rel=2e-3)


# 2 layers, hidden 4, 4 heads (head_dim 1), 2 KV heads, FFN 8, vocab 6, untied, llama (no biases).
# Per layer: q 16 + k 8 + v 8 + o 16 + gate, up, down 3 * 32 split elements, two norms of 4;
# embedding and head 24 each, final norm 4.
TINY = dict(model_type="llama", vocab_size=6, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
SPLIT_PER_LAYER, NORMS_PER_LAYER = 16 + 8 + 8 + 16 + 32 * 3, 8
# The same with 8 routed experts of FFN 2 in every layer (qwen3_moe: q/k norms of head_dim 1 beside them).
TINY_MOE = dict(TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=2,
                head_dim=1)
EXPERT = 3 * 2 * 4  # gate, up, down: 2 x 4 each


def test_traffic_by_hand():
    # TP 2 -> 1: each rank lacks the other half of every split tensor (bf16: 2 bytes), norms it has.
    r = plan(TINY, TrainLayout(2, 1, 1, 2), gen=1)["ranks"]
    split = 24 + 24 + 2 * SPLIT_PER_LAYER
    assert [x["sharded_recv"] for x in r] == [split // 2 * 2] * 2 == [x["sharded_send"] for x in r]
    # TP 2 -> 2: the generation shard is the training shard; full delivery still needs the other half.
    r = plan(TINY, TrainLayout(2, 1, 1, 2), gen=2)["ranks"]
    assert [x["sharded_recv"] for x in r] == [0, 0] and [x["full_recv"] for x in r] == [split, split]
    # PP 2 -> TP 1: stage 0 (embedding + layer 0) lacks layer 1 + norm + head, stage 1 the rest.
    r = plan(TINY, TrainLayout(1, 2, 1, 2), gen=1)["ranks"]
    stage0 = 24 + SPLIT_PER_LAYER + NORMS_PER_LAYER
    stage1 = SPLIT_PER_LAYER + NORMS_PER_LAYER + 4 + 24
    assert [x["full_recv"] for x in r] == [2 * stage1, 2 * stage0] == [x["full_send"] for x in r][::-1]
    # TP 1, DP 2 -> TP 2 sharded: every rank already holds everything.
    r = plan(TINY, TrainLayout(1, 1, 2, 2), gen=2)["ranks"]
    assert [x["sharded_recv"] for x in r] == [0, 0] and [x["full_recv"] for x in r] == [0, 0]


def test_memory_by_hand():
    s = MemorySettings(seq_len=8, micro_batch=1, distributed_optimizer=True, sequence_parallel=False)
    m = rank_memory(TINY, TrainLayout(2, 1, 2, 2), 0, s)
    params = (24 + 24 + 2 * SPLIT_PER_LAYER) // 2 + 2 * NORMS_PER_LAYER + 4
    assert m["params"] == params and m["weights"] == 2 * params and m["grads"] == 4 * params
    assert m["optimizer"] == 12 * params / 2 and m["host"] == 0
    # Per layer and token (h=4, q=4, kv=2, F=8, TP=2, bf16): two norms' inputs and outputs 4*2*4, QKV buffer +
    # rotated Q, K + output 2*(8+6+4)/2, fp32 log-sum-exp 4*4/2, MLP 2*4*8/2: 32+18+8+32 = 90 bytes; 8 tokens.
    layer = 8 * (32 + 18 + 8 + 32)
    assert m["activations"] == 2 * layer
    assert m["logits"] == 8 * 8 * 3  # fp32 logits and their gradient over 3 of the 6 vocabulary rows
    assert m["backward_working"] == layer
    assert m["peak"] == m["static"] + m["activations"] + m["logits"] + m["backward_working"]
    # CP 2 (of the 2 replicas): half of each sequence's activations, the same weights and optimizer.
    cp = rank_memory(TINY, TrainLayout(2, 1, 2, 2), 0, s, cp=2)
    assert cp["activations"] == m["activations"] / 2 and cp["optimizer"] == m["optimizer"]
    # Full recompute keeps each layer's input (2*4 bytes a token) and recomputes one layer in its backward.
    full = rank_memory(TINY, TrainLayout(2, 1, 2, 2), 0, MemorySettings(seq_len=8, recompute="full",
                                                                         sequence_parallel=False))
    assert full["activations"] == 2 * 8 * 8 and full["backward_working"] == 2 * layer
    # K/V at generation TP 4 with 2 KV heads: each rank keeps one head (2 layers * K,V * head_dim 1 * bf16)
    assert plan(TINY, TrainLayout(2, 1, 2, 2), 4, kv_tokens=10)["ranks"][0]["kv_cache"] == 10 * 2 * 2 * 1 * 1 * 2


def test_pipeline_keeps_one_micro_batch_in_flight_per_later_stage():
    s = MemorySettings(seq_len=8, sequence_parallel=False)
    acts = [rank_memory(TINY, TrainLayout(1, 2, 1, 2), p, s)["activations"] for p in range(2)]
    assert acts[0] == 2 * acts[1]  # 1F1B: stage 0 holds PP = 2 micro-batches, the last stage one
    one = rank_memory(TINY, TrainLayout(1, 2, 1, 2), 0, MemorySettings(seq_len=8, micro_batches=1))
    assert one["activations"] == acts[1]


# The CLI's plan of one layout (~2-6 s each on 2 cores, its sync traffic over 64-128 ranks) for one case of each model:
# the split it prints comes from the same train_layout the other cases check.
@pytest.mark.parametrize("model,pp,stages,through_cli", [
    ("deepseek-v3", 8, (7, 8, 8, 8, 8, 8, 8, 6), True),
    ("deepseek-v3", 16, (3,) + (4,) * 14 + (2,), False),
    ("qwen3-235b-a22b", 4, (23, 24, 24, 23), True),
    ("qwen3-235b-a22b", 16, (5,) + (6,) * 14 + (5,), False)])
def test_uneven_stages_plan_with_the_split_shown(model, pp, stages, through_cli, capsys):
    hf = load_model_config(model)
    assert train_layout(hf, dict(tp=1, pp=pp, cp=1, dp=1, ep=1, etp=1)).stage_layers == stages
    # Each routed expert sits on one of the 8 EP ranks of its stage, not on all of them.
    ep8, ep1 = (train_layout(hf, dict(tp=1, pp=pp, cp=1, dp=8, ep=ep, etp=1)) for ep in (8, 1))
    assert 8 * stage_params(hf, ep8, 1)[1] == stage_params(hf, ep1, 1)[1] > 0
    if through_cli:
        main(["--model", model, "--train", f"tp=1,pp={pp},dp=8,ep=8", "--gen", "tp=8,ep=8",
              "--distributed-optimizer"])
        out = capsys.readouterr().out
        assert f"pipeline stages (decoder layers): {','.join(map(str, stages))}" in out
        assert (f"actor.parallel.pp_first_stage_layers={stages[0]} actor.parallel.pp_last_stage_layers={stages[-1]}"
                in out)
        assert "recompute: none" in out and "micro-batch: 1 x 4096 tokens" in out and "dtype: bf16 weights" in out
        per_gpu = float(out.split("per-GPU peak: ")[1].split()[0]) * GiB
        assert per_gpu == pytest.approx(predict_peak(hf, ep8, MemorySettings(distributed_optimizer=True)), rel=1e-3)
    # A split given by hand is the one planned; one megatron cannot build names the flags and the engine's keys.
    given = train_layout(hf, dict(tp=1, pp=pp, cp=1, dp=1, ep=1, etp=1), stages[0] - 1, stages[-1] + 1)
    assert given.stage_layers == (stages[0] - 1,) + stages[1:-1] + (stages[-1] + 1,)
    with pytest.raises(ValueError, match="--pp-first-stage-layers=1 --pp-last-stage-layers=2: actor.parallel.pp_"):
        train_layout(hf, dict(tp=1, pp=pp, cp=1, dp=1, ep=1, etp=1), 1, 2)


@pytest.mark.parametrize("model,pp", [("deepseek-v3", 8), ("deepseek-v3", 16), ("qwen3-235b-a22b", 4),
                                      ("qwen3-235b-a22b", 16)])
def test_default_split_is_what_megatron_builds_from_the_printed_keys(model, pp):
    """The planner's split is megarl's engine's: the keys it prints, through the model family's TransformerConfig
    (what MegatronEngine builds), give each stage the layers megatron builds there."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megarl.config.tiny import tiny_config
    from megarl.config.model_layout import check_model_layout
    from megarl.models import get_family

    hf = load_model_config(model)
    planned = train_layout(hf, dict(tp=1, pp=pp, cp=1, dp=8, ep=8, etp=1)).stage_layers
    first, last = default_first_last(hf["num_hidden_layers"], pp)
    with pytest.raises(ValueError, match=f"actor.parallel.pp_first_stage_layers={first} "
                                         f"actor.parallel.pp_last_stage_layers={last}"):
        stage_layers(hf["num_hidden_layers"], pp, keys="actor.parallel")  # the engine's error suggests them
    cfg = tiny_config([f"actor.parallel.world_size={8 * pp}", f"actor.parallel.pp={pp}", "actor.parallel.ep=8",
                             f"actor.parallel.pp_first_stage_layers={first}",
                             f"actor.parallel.pp_last_stage_layers={last}"])
    p = cfg.actor.parallel
    assert check_model_layout(cfg.actor, "actor", hf, model) == planned  # the dry run's check
    config = get_family(hf).transformer_config(hf, p.tp, p.pp, torch.bfloat16, True, ep=p.ep,
                                               first_stage_layers=p.pp_first_stage_layers,
                                               last_stage_layers=p.pp_last_stage_layers)
    assert tuple(get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)) == planned


def test_default_split_rule():
    assert default_first_last(61, 8) == (7, 6) and default_first_last(61, 16) == (3, 2)
    assert default_first_last(64, 8) == (0, 0) and default_first_last(61, 2) == (31, 30)
    assert default_first_last(9, 8) == (2, 1)  # middle stages of one layer, first and last the rest
    assert stage_layers(9, 8, *default_first_last(9, 8)) == (2,) + (1,) * 7
    with pytest.raises(ValueError, match="pp=9 is more pipeline stages than num_hidden_layers=8"):
        default_first_last(8, 9)


def test_expert_parallelism_divides_expert_memory_by_hand():
    # 4 ranks, TP 2 x DP 2; 2 layers of 8 experts of 24 parameters each.
    dense_per_rank = (24 + 24 + 2 * (16 + 8 + 8 + 16)) // 2 + 2 * (NORMS_PER_LAYER + 2 + 8 * 4) + 4
    for ep, etp, experts_held in [(4, 1, 2), (2, 2, 4), (2, 1, 4), (1, 2, 8)]:
        train = TrainLayout(2, 1, 2, 2, ep=ep, etp=etp)
        dense, expert = stage_params(TINY_MOE, train, 0)
        assert dense == dense_per_rank, (ep, etp)
        assert expert == 2 * experts_held * EXPERT // etp, (ep, etp)
        # the distributed optimizer shards experts over the expert-DP group: world / (ETP x EP)
        m = rank_memory(TINY_MOE, train, 0, MemorySettings(distributed_optimizer=True))
        assert m["optimizer"] == 12 * (dense / 2 + expert / (4 // (etp * ep)))


def test_offload_moves_adams_moments_off_the_gpu_and_the_optimizer_to_host():
    train = TrainLayout(2, 1, 2, 2, ep=2, etp=1)
    dist = dict(distributed_optimizer=True, optimizer_offload=True)
    on_gpu = rank_memory(TINY_MOE, train, 0, MemorySettings(distributed_optimizer=True))
    off = rank_memory(TINY_MOE, train, 0, MemorySettings(**dist))
    half = rank_memory(TINY_MOE, train, 0, MemorySettings(**dist, offload_fraction=0.5))
    te = rank_memory(TINY_MOE, train, 0, MemorySettings(**dist, te_precision_aware_optimizer=True))
    # megarl's engine (no TransformerEngine): the 2 fp32 moments (8 of the 12 B) leave the GPU, the fp32 master
    # copy (4 B) stays: the drop tests/engine/test_layouts_gpu.py measures on an H200 (8 B per parameter)
    assert off["optimizer"] == on_gpu["optimizer"] / 3
    assert half["optimizer"] == on_gpu["optimizer"] * 2 / 3  # (12 B + 4 B) / 2 of the 12 B
    # TransformerEngine's precision-aware optimizer: the master copy leaves too
    assert te["optimizer"] == 0
    # the host holds fp32 master, grad copy and 2 moments, 16 B per offloaded sharded parameter, either way
    assert off["host"] == te["host"] == on_gpu["optimizer"] * 16 / 12 and half["host"] == off["host"] / 2
    assert (off["weights"], off["grads"], off["activations"]) == (on_gpu["weights"], on_gpu["grads"],
                                                                  on_gpu["activations"])
    # the CPU updates the offloaded part: torch's fp32 temporary only for what stays on the GPU's Adam
    assert off["step_transient"] == 0 < half["step_transient"] == on_gpu["step_transient"] / 2
    with pytest.raises(ValueError, match="distributed_optimizer"):
        MemorySettings(optimizer_offload=True)
    with pytest.raises(ValueError, match="te_precision_aware_optimizer: .* set optimizer_offload"):
        MemorySettings(distributed_optimizer=True, te_precision_aware_optimizer=True)


def test_cli_offload_assumption_is_printed_and_the_te_case_is_a_flag(capsys):
    args = ["--model", "qwen3-30b-a3b", "--train", "tp=1,pp=2,dp=4,ep=4", "--gen", "tp=4", "--optimizer-offload",
            "--recompute", "full"]
    main(args)
    megarl = capsys.readouterr().out
    main(args + ["--te-precision-aware-optimizer"])
    te = capsys.readouterr().out
    assert "Adam's 2 moments leave the GPU (8 B), the fp32 master stays (megarl's engine" in megarl
    assert "fp32 master and 2 moments leave the GPU (12 B: TransformerEngine's precision-aware" in te
    peak = [float(out.split("per-GPU peak: ")[1].split()[0]) for out in (megarl, te)]
    host = [out.split("host memory of the offloaded optimizer: ")[1].split()[0] for out in (megarl, te)]
    assert peak[0] > peak[1] and host[0] == host[1]


def test_gpus_and_memory_list_only_layouts_that_fit(capsys):
    hf = load_model_config("qwen2.5-7b")
    settings = MemorySettings(seq_len=2048, distributed_optimizer=True)
    budget = 40 * GiB
    found = fitting_layouts(hf, 8, budget, settings)
    assert found and all(r["peak"] <= budget for r in found)
    for r in found:  # the peak listed is the layout's own prediction
        train = TrainLayout(r["tp"], r["pp"], r["dp"], 28, r["stage_layers"])
        assert predict_peak(hf, train, settings) == r["peak"]
    assert (1, 1) not in {(r["tp"], r["pp"]) for r in found}  # all on every GPU needs ~19 B x 7.6B
    assert predict_peak(hf, TrainLayout(1, 1, 8, 28), settings) > budget
    # the CLI keeps a margin (5% by default) free: a layout fits 40 GiB at a peak of at most 38 GiB
    listed = fitting_layouts(hf, 8, 0.95 * budget, settings)
    tight = [r for r in found if r not in listed]
    assert len(listed) == 6 and len(tight) == 1  # tp=1,pp=2 at 38.74 GiB: inside the margin
    assert main(["--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "40", "--seq-len", "2048",
                 "--distributed-optimizer", "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("qwen2.5-7b: 6 layout(s) of 8 GPUs fit 40 GiB per GPU with a 5% margin (predicted peak at "
                          "most 38.00 GiB") and "; best 4 shown (--top 4), best first" in out
    assert [line.split()[2] for line in out.splitlines() if ". --train tp=" in line] == [
        ",".join(f"{k}={r[k]}" for k in ("tp", "pp", "cp", "dp", "ep", "etp")) for r in listed[:4]]
    assert "  1. --train tp=4,pp=1,cp=1,dp=2,ep=1,etp=4 " in out and "peak   24.83 GiB,  15.17 GiB free" in out
    assert f"  1 more fit 40 GiB only inside the 5% margin (peak {tight[0]['peak'] / GiB:.2f} GiB): not counted" in out
    main(["--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "40", "--seq-len", "2048", "--distributed-optimizer",
          "--margin", "0"])
    out = capsys.readouterr().out
    assert "7 layout(s) of 8 GPUs fit 40 GiB per GPU with a 0% margin" in out and "; all shown" in out


@pytest.mark.parametrize("argv", [
    ["--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu-mem", "80", "--optimizer-offload", "--recompute", "selective",
     "--recompute-modules", "moe,core_attn", "--seq-len", "8192", "--top", "30"],
    ["--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "40", "--seq-len", "2048", "--distributed-optimizer"],
    list(DEEPSEEK_128_GPUS),
    # Qwen3-Next (linear attention at a TP dividing its key heads) and gpt-oss (experts at expert-TP 1)
    ["--model", "qwen3-next-80b-a3b", "--gpus", "32", "--gpu-mem", "80", "--optimizer-offload", "--recompute", "full",
     "--top", "6"],
    ["--model", "gpt-oss-120b", "--gpus", "32", "--gpu-mem", "80", "--host-mem", "1500", "--optimizer-offload",
     "--recompute", "full", "--top", "6"],
])
def test_each_listed_layout_is_a_line_of_run_keys_that_plans_to_the_same_peak(argv):
    """Each printed override line, loaded by megarl's config loader, is a valid config with the listed layout, which
    the dry run's checks against the model accept and for which the dry run's memory line predicts the listed peak."""
    import shlex

    from megarl.config import load_config
    from megarl.config.model_layout import check_model_layout
    from megarl.reshard.plan import run_memory

    lines = cli_output(*argv).splitlines()
    rows = [(line, lines[i + 1]) for i, line in enumerate(lines) if ". --train tp=" in line]
    assert rows
    hf = load_model_config(argv[1])
    for row, keys in rows:
        layout = dict(part.split("=") for part in row.split()[2].split(","))
        cfg = load_config(None, shlex.split(keys))
        p = cfg.actor.parallel
        assert {k: str(v) for k, v in dict(tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp, ep=p.ep, etp=p.etp or p.tp).items()} \
            == layout
        check_model_layout(cfg.actor, "actor", hf, "config.json")
        line, _ = run_memory(hf, cfg.actor, cfg.rollout, reference=False, longest_prompt=0, response_tokens=0)
        assert f"training peak {row.split('peak')[1].split()[0]} GiB" in line, (row, line)


def test_when_nothing_fits_the_nearest_layouts_and_what_would_fit_are_named(capsys):
    assert main(["--model", "qwen2.5-7b", "--gpus", "2", "--gpu-mem", "24", "--seq-len", "4096"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("qwen2.5-7b: 0 layout(s) of 2 GPUs fit 24 GiB per GPU")
    nearest = out.split("The nearest:\n")[1].split("what would make one fit:")[0].splitlines()
    assert len(nearest) == 3 and nearest[0].startswith("  --train tp=2,pp=1,cp=1,dp=1,ep=1,etp=2") \
        and nearest[0].endswith("GiB over")
    assert "  - more GPUs: --gpus 8: 1 layout(s) fit, the best --train tp=4,pp=2" in out
    assert "  - --optimizer-offload (actor.use_distributed_optimizer=true actor.optimizer_cpu_offload=true" in out
    assert "  - --recompute full (actor.recompute=full): still none" in out
    assert "  - LoRA, e.g. --lora-rank 16 --lora-targets all-linear (actor.lora.rank=16 " in out
    # a plan of one layout that misses --gpu-mem exits 1 too; inside the margin is said apart from over the memory
    assert main(["--model", "qwen2.5-7b", "--train", "tp=2", "--gen", "tp=1", "--seq-len", "4096",
                 "--gpu-mem", "80"]) == 1
    out = capsys.readouterr().out
    assert "run keys: actor.parallel.world_size=2 actor.parallel.tp=2 actor.parallel.pp=1 " in out
    assert "training fits (78.02 GiB" not in out and "does NOT fit with the 5% margin (78.02 GiB, only 1.98 GiB free)" \
        in out


def test_gpus_and_memory_say_which_sglang_server_fits_or_that_none_does(capsys):
    # colocated, generation holds each GPU alone: its ranks' bf16 weights and KV cache must fit the budget
    hf = load_model_config("qwen2.5-7b")
    layouts = {g["tp"]: g for g in generation_layouts(hf, 8, 65536)}
    assert sorted(layouts) == [1, 2, 4]  # TP=8 does not divide the 28 heads
    assert layouts[2]["weights"] + layouts[2]["kv_cache"] <= 10 * GiB < layouts[1]["weights"] + layouts[1]["kv_cache"]
    assert layouts[2]["kv_cache"] == kv_bytes_per_token(hf, 2) * 65536
    main(["--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "10", "--seq-len", "512", "--distributed-optimizer"])
    assert "the smallest SGLang server that fits is --gen tp=2,ep=1" in capsys.readouterr().out
    # DeepSeek-V3 in bf16 needs more than a node of 8 GPUs: training fits, serving does not, and the plan says so
    out = cli_output(*DEEPSEEK_128_GPUS)
    assert "  1. --train tp=" in out
    assert "generation: no SGLang server within a node of 8 GPUs fits 123.50 GiB: at TP=8" in out
    # one layout: whether each side fits
    main(["--model", "deepseek-v3", "--train", "tp=1,pp=8,dp=16,ep=8", "--gen", "tp=8,ep=8", "--optimizer-offload",
          "--recompute", "full", "--seq-len", "8192", "--gpu-mem", "130"])
    out = capsys.readouterr().out
    peak = float(out.split("per-GPU peak: ")[1].split()[0])
    serving = float(out.split("generation per rank: ")[1].split(" = ")[1].split()[0])
    assert peak < 130 < serving
    assert (f"on GPUs of 130 GiB with a 5% margin (--margin: for what the memory model leaves out): training fits "
            f"({peak:.2f} GiB, {130 - peak:.2f} GiB free), generation does NOT fit ({serving:.2f} GiB)") in out


@pytest.mark.parametrize("run", ["2026-11-22_engine_h200x2_dp2_sdpa", "2026-11-22_engine_h200x2_cp2_sdpa",
                                 "2026-11-22_engine_h200x2_tp2_varlen"])
def test_predicts_recorded_gpu_peaks_within_15_percent(run):
    """benchmarks/engine_throughput.py's measured torch.cuda.max_memory_allocated() (docs/results)."""
    d = json.loads((RESULTS / f"{run}.json").read_text())
    layout, args = d["layout"], d["args"]
    train = TrainLayout(layout["tp"], layout["pp"], layout["cp"] * layout["dp"], d["model"]["num_hidden_layers"])
    settings = MemorySettings(seq_len=args["seq"], micro_batch=args["max_tokens"] // args["seq"],
                              sequence_parallel=d["sequence_parallel"])
    predicted = predict_peak(d["model"], train, settings, layout["cp"]) / GiB
    assert predicted == pytest.approx(d["engine"]["peak_memory_gib"], rel=0.15)


def test_kv_cache_per_token():
    assert kv_bytes_per_token(load_model_config("qwen2.5-7b"), 2) == 28 * 2 * 2 * 128 * 2
    assert kv_bytes_per_token(load_model_config("deepseek-v3"), 8) == 61 * (512 + 64) * 2


def test_generation_expert_parallelism_holds_a_block_of_experts():
    tp = plan(TINY_MOE, TrainLayout(2, 1, 2, 2), GenLayout(2, 1), traffic=False)["ranks"]
    ep = plan(TINY_MOE, TrainLayout(2, 1, 2, 2), GenLayout(2, 2), traffic=False)["ranks"]
    # TP 2 cuts each of the 8 experts in halves; EP 2 gives each rank 4 whole experts of each layer instead
    assert tp[0]["gen_weights"] == ep[0]["gen_weights"] == ep[1]["gen_weights"]
    dense = (24 + 24 + 2 * (16 + 8 + 8 + 16)) // 2 + 2 * (NORMS_PER_LAYER + 2 + 8 * 4) + 4
    assert ep[0]["gen_weights"] == 2 * (dense + 2 * 4 * EXPERT)


def test_cli_prints_every_stage(capsys):
    main(["--model", "qwen2.5-7b", "--train", "tp=2,pp=2,dp=1", "--gen", "tp=4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("qwen2.5-7b: 7.62B parameters")
    table = lines.index(next(x for x in lines if x.startswith("stage layers")))
    assert [line.split()[:2] for line in lines[table + 1:table + 3]] == [["0", "14"], ["1", "14"]]
    main(["--model", "qwen2.5-7b", "--train", "tp=2,cp=2,dp=2", "--gen", "tp=4"])
    assert "train TP=2 PP=1 CP=2 DP=2 EP=1 ETP=2 (8 GPUs)" in capsys.readouterr().out


def test_cli_plans_mixtral_with_expert_parallelism(capsys):
    """Mixtral's experts (8 of intermediate_size 14336 per layer, under block_sparse_moe) split over EP x ETP in
    training: a rank of a 16-layer stage holds 16 x 8 x 3 x 14336 x 4096 / (2 x 2) expert parameters, 16 x 41.9M / 2
    of attention and half the embedding or the output layer (6.039B); Mistral has no experts to split."""
    main(["--model", "mixtral-8x7b", "--train", "tp=2,pp=2,dp=2,ep=2", "--gen", "tp=8,ep=8"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("mixtral-8x7b: 46.70B parameters; train TP=2 PP=2 CP=1 DP=2 EP=2 ETP=2 (8 GPUs), "
                        "generation TP=8 EP=8 DP=1")
    table = lines.index(next(x for x in lines if x.startswith("stage layers")))
    assert [line.split()[:3] for line in lines[table + 1:table + 3]] == [["0", "16", "6.039"], ["1", "16", "6.039"]]
    with pytest.raises(ValueError, match="ep=2: model_type='mistral' has no routed experts"):
        train_layout(load_model_config("mistral-7b-v0.3"), dict(tp=1, pp=1, dp=1, cp=1, ep=2, etp=0))


def test_cli_plans_glm_4_5_air_with_its_dense_first_layer(capsys):
    """GLM-4.5-Air at TP=2, PP=2, EP=4 x ETP=2: a rank of stage 0 holds half the embedding, 23 layers' attention (q, k,
    v with biases and o: 109.07M / 2) and norms, layer 0's dense MLP (3 x 10944 x 4096 / 2) and 22 MoE layers (the
    router and its bias whole, 128 experts of 3 x 1408 x 4096 / (4 x 2), the shared expert / 2): 7.924B; stage 1 23 MoE
    layers, the final norm and half the output layer: 8.143B."""
    main(["--model", "glm-4.5-air", "--train", "tp=2,pp=2,dp=4,ep=4", "--gen", "tp=8,ep=8"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("glm-4.5-air: 106.85B parameters; train TP=2 PP=2 CP=1 DP=4 EP=4 ETP=2 (16 GPUs), "
                        "generation TP=8 EP=8 DP=2")
    table = lines.index(next(x for x in lines if x.startswith("stage layers")))
    assert [line.split()[:3] for line in lines[table + 1:table + 3]] == [["0", "23", "7.924"], ["1", "23", "8.143"]]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="bad layout entry 'tq=2'"):
        parse_layout("tq=2", ("tp", "pp", "dp"))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model_config("no-such-model")
    with pytest.raises(SystemExit, match="python -m megarl.plan: --model no-such-model: not a config.json path"):
        main(["--model", "no-such-model", "--train", "tp=1"])  # the CLI's one line, no traceback
    with pytest.raises(ValueError, match="generation TP=3"):
        plan(TINY, TrainLayout(2, 1, 2, 2), gen=3)
    with pytest.raises(ValueError, match="does not divide its 3 heads"):
        plan(dict(TINY, num_key_value_heads=3, num_attention_heads=3, hidden_size=6), TrainLayout(2, 1, 1, 2), 2)
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 routed experts"):
        train_layout(TINY_MOE, dict(tp=1, pp=1, cp=1, dp=3, ep=3, etp=1))
    with pytest.raises(ValueError, match="ep=2: model_type='llama' has no routed experts"):
        train_layout(TINY, dict(tp=1, pp=1, cp=1, dp=2, ep=2, etp=1))
    with pytest.raises(ValueError, match="ETP=2 x EP=4"):
        train_layout(TINY_MOE, dict(tp=2, pp=1, cp=1, dp=2, ep=4, etp=2))
    with pytest.raises(ValueError, match="generation EP=3"):
        GenLayout(4, 3)
    with pytest.raises(ValueError, match="recompute='some'"):
        MemorySettings(recompute="some")
    with pytest.raises(SystemExit, match="ep=3 does not divide"):
        main(["--model", "deepseek-v3", "--train", "tp=1,pp=1,dp=3,ep=3"])


def test_hybrid_attention_models_train_and_plan_at_tp2():
    """Qwen3.5-MoE and Qwen3-Next at TP=2 (sequence parallel, as MoE at TP > 1 needs): the dry run's layout check and
    the planner accept it (their gated delta nets split by heads: models/gated_delta_net.py; the weight sync gathers
    them: tests/models/test_qwen3_5.py's GRPO run)."""
    import shlex

    from megarl.config import load_config
    from megarl.config.model_layout import check_model_layout

    for model in ("qwen3.5-397b-a17b", "qwen3-next-80b-a3b"):
        hf = load_model_config(model)
        cfg = load_config(None, shlex.split("actor.parallel.world_size=2 actor.parallel.tp=2 "
                                            "actor.parallel.sequence_parallel=true"))
        check_model_layout(cfg.actor, "actor", hf, "config.json")
        assert train_layout(hf, dict(tp=2, pp=1, cp=1, dp=1, ep=1, etp=2)).tp == 2


@pytest.mark.parametrize("model, keys, named", [
    ("gpt-oss-20b", "actor.parallel.world_size=2 actor.parallel.tp=2", "actor.parallel.etp=0 (0 = tp, here 2)"),
    ("gpt-oss-20b", "actor.parallel.world_size=4 actor.parallel.tp=2 actor.parallel.ep=2 actor.parallel.etp=2",
     "actor.parallel.etp=2"),
    # context parallelism: megatron's gated delta net refuses it; megatron's unfused attention (windows, sinks) lacks it
    ("qwen3.5-397b-a17b", "actor.parallel.world_size=2 actor.parallel.cp=2", "actor.parallel.cp=2 with"),
    ("qwen3-next-80b-a3b", "actor.parallel.world_size=2 actor.parallel.cp=2", "actor.parallel.cp=2 with"),
    ("gemma-3-4b", "actor.parallel.world_size=2 actor.parallel.cp=2", "actor.parallel.cp=2 with"),
    ("gpt-oss-20b", "actor.parallel.world_size=2 actor.parallel.cp=2", "actor.parallel.cp=2 with")])
def test_layouts_a_family_cannot_train_are_refused_by_key_and_never_planned(model, keys, named):
    import shlex

    from megarl.config import load_config
    from megarl.config.model_layout import check_model_layout
    from megarl.config.validation import ConfigError

    hf = load_model_config(model)
    cfg = load_config(None, shlex.split(keys))
    with pytest.raises(ConfigError, match=r"set actor\.parallel\.(e?tp|cp)=1") as refused:
        check_model_layout(cfg.actor, "actor", hf, "config.json")
    assert named in str(refused.value)
    p = cfg.actor.parallel
    with pytest.raises(ValueError, match="only"):
        train_layout(hf, dict(tp=p.tp, pp=1, cp=p.cp, dp=1, ep=p.ep, etp=p.etp or p.tp))

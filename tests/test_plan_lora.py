"""The planner with LoRA (actor.lora): the adapters it counts are the engine's trainable parameters, rank by rank
(dense and MoE, TP, EP and expert-TP); a LoRA rank's bytes are full fine-tuning's less the base's gradients and
optimizer state, exactly, and no reference copy; a model full fine-tuning cannot fit on a node fits with LoRA, and
the printed run keys load as a valid config; the dry run prints the LoRA-aware peak."""

import re
import shlex

import pytest

from megarl.reshard.layout import TrainLayout
from megarl.reshard.memory import (GiB, MemorySettings, adapter_params, model_adapters, predict_peak, rank_memory,
                                   stage_params)
from megarl.reshard.plan import load_model_config, main, train_layout
from tests.dist_utils import run_distributed
from tests.models.hf_families import glm4_moe_config
from tests.test_plan import TINY, TINY_MOE

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _trainable_per_rank(rank, layouts, model_dirs):
    """Each layout's engine, built on a tiny model's config.json: the parameters that require a gradient, per rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.config.sections import LoraConfig, ParallelConfig
    from megarl.engine import MegatronEngine
    from megarl.parallel.state import build_model_parallel

    counts = []
    for (model, tp, ep, targets), model_dir in zip(layouts, model_dirs):
        parallel_state.destroy_model_parallel()
        build_model_parallel(tp, 1, 1, ep=ep)
        section = ActorConfig(micro_batch_size=2, lora=LoraConfig(rank=4, target_modules=list(targets)),
                              parallel=ParallelConfig(sequence_parallel=tp > 1))  # megatron's MoE at TP needs SP
        engine = MegatronEngine(model_dir, section, AlgorithmConfig(), "cpu", 1, 10, load_hf_weights=False)
        mine = torch.tensor([sum(p.numel() for p in engine._parameters() if p.requires_grad)])
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        counts.append([int(c) for c in every])
    return counts


def test_adapters_counted_are_the_engines_trainable_parameters_on_every_rank(tmp_path):
    """GLM-4.5 at a tiny size (attention with biases, a dense first layer, a shared expert and 8 routed experts) at
    TP=1, EP=2 and TP=2 (expert-TP 2), all-linear; and a dense model (its first layer) at TP=2 with three targets."""
    from tests.models.hf_families import qwen3_config

    glm, dense = glm4_moe_config(), qwen3_config(tied=False)
    for name, config in (("glm", glm), ("dense", dense)):
        config.save_pretrained(tmp_path / name)
    some = ("q_proj", "v_proj", "down_proj")
    layouts = [("glm", 1, 1, ["all-linear"]), ("glm", 1, 2, ["all-linear"]), ("glm", 2, 1, ["all-linear"]),
               ("dense", 2, 1, list(some))]
    counts = run_distributed(_trainable_per_rank, 2, layouts, [str(tmp_path / m) for m, *_ in layouts])
    for (model, tp, ep, targets), engine in zip(layouts, counts):
        hf = (glm if model == "glm" else dense).to_dict()
        settings = MemorySettings(lora_rank=4, lora_targets=ALL if targets == ["all-linear"] else some)
        train = TrainLayout(tp, 1, 2 // tp, hf["num_hidden_layers"], ep=ep, etp=tp)
        planned = [sum(adapter_params(hf, train, 0, settings, r % tp, r % tp)) for r in range(2)]
        assert planned == engine, (model, tp, ep, planned, engine)
        assert planned[0] > 0
    # the whole model's adapters: each TP=1 rank holds them all
    assert model_adapters(glm.to_dict(), MemorySettings(lora_rank=4)) == counts[0][0]


def test_adapter_counts_by_hand():
    # TINY (hidden 4, 4 heads of 1, 2 KV heads, FFN 8) at rank 2, TP=2: q [4, 4] and gate/up [8, 4] column-parallel
    # (A 2 x 4 whole, B half the rows x 2), o [4, 4] and down [4, 8] row-parallel (A 2 x half the columns, B 4 x 2)
    s = MemorySettings(lora_rank=2)
    per_layer = (8 + 4) + 2 * (8 + 2) + (4 + 8) + 2 * (8 + 8) + (8 + 8)  # q, k and v, o, gate and up, down
    assert adapter_params(TINY, TrainLayout(2, 1, 1, 2), 0, s) == (2 * per_layer, 0)
    assert model_adapters(TINY, s) == 2 * 2 * (4 + 4 + 2 * (2 + 4) + 4 + 4 + 2 * (8 + 4) + (4 + 8))
    only_q = MemorySettings(lora_rank=2, lora_targets=("q_proj",))
    assert adapter_params(TINY, TrainLayout(2, 1, 1, 2), 0, only_q) == (2 * (8 + 4), 0)
    # TINY_MOE's 8 experts (gate, up [2, 4], down [4, 2]) over EP=2 x ETP=1: 4 experts' adapters on each rank
    expert = 2 * 2 * (4 + 2) + 2 * (2 + 4)
    moe = adapter_params(TINY_MOE, TrainLayout(1, 1, 2, 2, ep=2, etp=1), 0, MemorySettings(lora_rank=2))
    assert moe == (2 * 2 * (4 + 4 + 2 * (2 + 4) + 4 + 4), 2 * 4 * expert)
    # published shapes: Qwen2.5-7B at r=16 on all-linear (docs/lora.md); Mixtral's experts under w1, w3, w2
    assert model_adapters(load_model_config("qwen2.5-7b"), MemorySettings(lora_rank=16)) == 40_370_176
    mixtral = 32 * (16 * (4096 + 4096) * 2 + 16 * (4096 + 1024) * 2 + 8 * 3 * 16 * (4096 + 14336))
    assert model_adapters(load_model_config("mixtral-8x7b"), MemorySettings(lora_rank=16)) == mixtral


@pytest.mark.parametrize("model, layout, optimizer", [
    (TINY, dict(tp=2, pp=1, cp=1, dp=2, ep=1, etp=2), dict()),
    (TINY, dict(tp=1, pp=2, cp=1, dp=2, ep=1, etp=1), dict(distributed_optimizer=True)),
    (TINY_MOE, dict(tp=2, pp=1, cp=1, dp=2, ep=2, etp=1), dict(distributed_optimizer=True, optimizer_offload=True,
                                                                offload_fraction=0.5))])
def test_lora_sheds_the_bases_gradients_and_optimizer_state_exactly(model, layout, optimizer):
    train = train_layout(model, layout)
    for stage in range(train.pp):
        full = rank_memory(model, train, stage, MemorySettings(seq_len=8, reference=True, **optimizer))
        lora = rank_memory(model, train, stage, MemorySettings(seq_len=8, reference=True, lora_rank=2, **optimizer))
        dense, expert = stage_params(model, train, stage)
        a_dense, a_expert = adapter_params(model, train, stage, MemorySettings(lora_rank=2))
        assert lora["params"] == full["params"] == dense + expert and lora["adapters"] == a_dense + a_expert > 0
        # the base: its bf16 weights alone; the adapters: bf16 weights, fp32 gradients and Adam, as trained params
        assert lora["weights"] == full["weights"] + 2 * lora["adapters"]
        assert lora["grads"] == 4 * lora["adapters"] == full["grads"] - 4 * (dense + expert - lora["adapters"])
        kept = 12 if not optimizer.get("optimizer_offload") else 12 - 8 * optimizer["offload_fraction"]
        if optimizer.get("distributed_optimizer"):
            shards, base = a_dense / train.dp + a_expert / train.expert_dp, dense / train.dp + expert / train.expert_dp
        else:
            shards, base = a_dense + a_expert, dense + expert
        assert lora["optimizer"] == pytest.approx(kept * shards) and full["optimizer"] == pytest.approx(kept * base)
        # no reference copy: the base with the adapters off is the reference
        assert lora["reference"] == 0 < full["reference"] == 2 * full["params"]
        assert lora["static"] == pytest.approx(full["static"] - 4 * (dense + expert) - (full["optimizer"] -
                                               lora["optimizer"]) - full["reference"] + 6 * lora["adapters"])
        assert (lora["activations"], lora["logits"]) == (full["activations"], full["logits"])


def test_a_70b_model_fits_a_node_of_80gib_gpus_with_lora_only(capsys):
    """Qwen2.5-72B on 8 GPUs of 80 GiB: no layout of full fine-tuning fits, and the planner names LoRA as the change
    that does; with --lora-rank 16 the listed layouts' run keys load as a valid LoRA config, pass the dry run's model
    checks and give the dry run's memory line the listed peak."""
    from megarl.config import load_config
    from megarl.config.model_layout import check_model_layout
    from megarl.reshard.plan import run_memory

    common = ["--model", "qwen2.5-72b", "--gpus", "8", "--gpu-mem", "80", "--recompute", "full"]
    assert main(common) == 1
    full = capsys.readouterr().out
    assert "0 layout(s) of 8 GPUs fit" in full and "  - LoRA: off (full fine-tuning" in full
    lora_line = next(line for line in full.splitlines() if line.startswith("  - LoRA, e.g. --lora-rank 16"))
    assert "actor.lora.rank=16 actor.lora.target_modules=all-linear" in lora_line and "layout(s) fit" in lora_line
    assert main(common + ["--lora-rank", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [(line, out.splitlines()[i + 1]) for i, line in enumerate(out.splitlines()) if ". --train tp=" in line]
    assert len(rows) == 3 and "  - LoRA: rank 16 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in out
    hf = load_model_config("qwen2.5-72b")
    for row, keys in rows:
        assert "actor.lora.rank=16 actor.lora.target_modules=all-linear" in keys
        cfg = load_config(None, shlex.split(keys))
        assert cfg.actor.lora.rank == 16 and cfg.actor.lora.target_modules == ["all-linear"]
        check_model_layout(cfg.actor, "actor", hf, "config.json")
        line, _ = run_memory(hf, cfg.actor, cfg.rollout, reference=True, longest_prompt=0, response_tokens=0)
        assert f"training peak {row.split('peak')[1].split()[0]} GiB" in line, (row, line)
        assert "LoRA rank 16 on q_proj," in line and "the KL reference is the base, no copy" in line
    # the same layout under full fine-tuning: far over the GPU
    best = dict(zip(("tp", "pp", "cp", "dp", "ep", "etp"), (int(v.split("=")[1]) for v in
                                                            rows[0][0].split()[2].split(","))))
    train = train_layout(hf, best)
    assert predict_peak(hf, train, MemorySettings(recompute="full")) > 80 * GiB > predict_peak(
        hf, train, MemorySettings(recompute="full", lora_rank=16))


def test_cli_lora_flags_and_what_the_engine_cannot_adapt(capsys):
    main(["--model", "qwen2.5-7b", "--train", "tp=2", "--gen", "tp=2", "--lora-rank", "16", "--lora-targets",
          "q_proj,v_proj"])
    out = capsys.readouterr().out
    # 28 layers x 16 x (q: 3584 + 3584, v: 3584 + 512)
    assert "LoRA: 5.05M adapter parameters in all (rank 16 on q_proj,v_proj); the rest frozen" in out
    assert "stage layers  params(B) adapters(M) |" in out
    assert "actor.lora.rank=16 actor.lora.target_modules=[q_proj,v_proj]" in out
    with pytest.raises(SystemExit, match=r"--lora-targets qkv: qkv is not among q_proj"):
        main(["--model", "qwen2.5-7b", "--train", "tp=1", "--lora-rank", "8", "--lora-targets", "qkv"])
    # multi-latent attention takes no q/k/v adapters in the engine; its o_proj and MLP projections do
    with pytest.raises(SystemExit, match=r"q_proj,k_proj,v_proj take no adapters in model_type='deepseek_v3'.*"
                                         r"o_proj,gate_proj,up_proj,down_proj"):
        main(["--model", "deepseek-v3", "--train", "tp=1,pp=8,dp=16,ep=8", "--lora-rank", "8"])


def test_dry_run_prints_the_lora_peak(tmp_path, capsys):
    from megarl.config.tiny import TINY_ARGS
    from megarl.models.tiny import build_char_tokenizer
    from megarl.train import main as train_main
    from tests.models.hf_families import save_random

    model = save_random(glm4_moe_config(), tmp_path / "glm", seed=3)
    build_char_tokenizer().save_pretrained(model)
    args = ["--dry-run", *TINY_ARGS, f"model.path={model}", "actor.parallel.world_size=2", "actor.parallel.ep=2",
            "actor.max_tokens_per_micro_batch=256", "algorithm.kl_coef=0.01", "sft.steps=0"]
    lines = {}
    for name, extra in (("full", []), ("lora", ["actor.lora.rank=8"])):
        capsys.readouterr()
        assert train_main(args + extra) == 0
        lines[name] = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted GPU memory"))
    hf = load_model_config(model)
    train = train_layout(hf, dict(tp=1, pp=1, cp=1, dp=2, ep=2, etp=1))
    lora = MemorySettings(seq_len=256, reference=True, lora_rank=8)
    peak = predict_peak(hf, train, lora)
    assert f"training peak {peak / GiB:.2f} GiB per GPU" in lines["lora"], lines["lora"]
    assert f"training peak {predict_peak(hf, train, MemorySettings(seq_len=256, reference=True)) / GiB:.2f}" \
        in lines["full"] and "LoRA" not in lines["full"]
    most = rank_memory(hf, train, 0, lora)
    assert re.search(rf"LoRA rank 8 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, on that GPU: the "
                     rf"frozen bf16 base {2 * most['params'] / GiB:.2f} GiB, {most['adapters'] / 1e6:.2f}M adapter "
                     r"parameters .* GiB with their gradients and optimizer state; the KL reference is the base",
                     lines["lora"]), lines["lora"]

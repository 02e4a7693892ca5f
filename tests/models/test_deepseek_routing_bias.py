"""DeepSeek-V3's routing bias (megatron's router.expert_bias, HF's mlp.gate.e_score_correction_bias) in a bf16
policy: it stays float32 while every other weight is bf16, and both weight paths deliver it so.
- A V3 config.json without topk_method (transformers' DeepseekV3 has the bias all the same): the inventory lists
  exactly the HF tensors the weight maps export, bias included, the bias alone marked fp32.
- PP=2 in bf16, the bias on the second stage: export_hf_weights and the resharder (generation TP 1 and 2, both
  deliveries) give every rank the checkpoint's float32 bias bitwise, and every other tensor in bf16, the
  checkpoint's rounded (transformers saved the tiny model in float32).
- A skipped update (trainer.skip_nonfinite_updates) with the bias update on leaves the bias where it was: megatron
  moves it inside finalize_model_grads, before the update is judged; applied updates move it.
"""

import json

import torch
from safetensors.torch import load_file

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from megarl.reshard.inventory import hf_inventory
from tests.dist_utils import run_distributed
from tests.models.hf_families import deepseek_v2_config, deepseek_v3_config, save_random

BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"


def _v3_dir_without_topk_method(path, **config) -> str:
    model_dir = save_random(deepseek_v3_config(**config), path, seed=5)
    config_file = path / "config.json"
    hf = json.loads(config_file.read_text())
    hf.pop("topk_method", None)
    config_file.write_text(json.dumps(hf))
    return model_dir


def test_inventory_lists_what_the_weight_maps_export_bias_in_fp32(tmp_path):
    from megarl.models import get_family

    without = json.loads(open(_v3_dir_without_topk_method(tmp_path / "v3", layers=2, first_k_dense_replace=1)
                              + "/config.json").read())
    assert without["model_type"] == "deepseek_v3" and "topk_method" not in without
    configs = {"v3 without topk_method": without,
               "v3": deepseek_v3_config(layers=2, first_k_dense_replace=1).to_dict(),
               "v2": deepseek_v2_config(layers=2, first_k_dense_replace=1).to_dict()}
    for where, hf in configs.items():
        exported = {n for wm in get_family(hf).weight_maps(hf, 1) if wm.export for n in wm.hf}
        specs = hf_inventory(hf)
        assert sorted(s.name for s in specs) == sorted(exported), where
        fp32 = {s.name for s in specs if s.fp32}
        assert fp32 == (set() if where == "v2" else {BIAS.format(1)}), where


def _delivered(rank, model_dir):
    """Every HF tensor as export_hf_weights gives it, and as the resharder gives it per (gen TP, delivery)."""
    from megarl.engine import MegatronEngine
    from megarl.reshard.resharder import engine_resharder

    actor = ActorConfig(parallel=ParallelConfig(world_size=2, pp=2), precision="bf16")
    engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
    assert engine.params_dtype == torch.bfloat16
    out = {"export": {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}}
    resharder = engine_resharder(engine, rank)
    for gen in (1, 2):
        for delivery in ("full", "sharded"):
            out[(gen, delivery)] = {n: t.clone() for bucket in resharder.buckets(gen, delivery, 4 << 10, torch.bfloat16)
                                    for n, t in bucket}
    specs = {s.name: s for s in resharder.specs}
    return rank, out, {n: dtype for n, (_, dtype) in engine.hf_tensors.items()}, specs


def _check_delivered(rank, delivered, checkpoint, specs, where):
    for name, tensor in delivered.items():
        spec, expected = specs[name], checkpoint[name]
        if where[1] == "sharded" and spec.dim is not None:
            lo, hi = spec.rows(where[0], rank % where[0])
            expected = expected.narrow(spec.dim, lo, hi - lo)
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected), (where, rank, name)
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected.bfloat16()), (where, rank, name)


def test_bf16_policy_at_pp2_delivers_the_fp32_routing_bias_bitwise(tmp_path):
    model_dir = _v3_dir_without_topk_method(tmp_path / "v3", layers=2, first_k_dense_replace=1)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    bias = checkpoint[BIAS.format(1)]
    assert bias.dtype == torch.float32 and not torch.equal(bias, bias.bfloat16().float())  # bf16 would round it

    gathered = run_distributed(_gather_delivered, 2, model_dir, pp=2, timeout=300)

    for rank, out, dtypes, specs in gathered:
        assert dtypes == {n: torch.float32 if n == BIAS.format(1) else torch.bfloat16 for n in checkpoint}
        assert sorted(out["export"]) == sorted(checkpoint)
        _check_delivered(rank, out["export"], checkpoint, specs, ("export", "full"))
        for where, delivered in out.items():
            if where != "export":
                assert BIAS.format(1) in delivered, where  # every generation rank holds the bias
                _check_delivered(rank, delivered, checkpoint, specs, where)


def _gather_delivered(rank, model_dir):
    import torch.distributed as dist

    mine = _delivered(rank, model_dir)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _skipped_update_rank(rank, model_dir):
    from megarl.engine import MegatronEngine
    from tests.engine.test_nonfinite import _share

    engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-2),
                                                   moe_router_bias_update_rate=0.01),
                            AlgorithmConfig(), "cpu", 1, 10, skip_nonfinite_updates=True)
    (router,) = [m for m in engine.gpt.modules() if hasattr(m, "expert_bias") and m.expert_bias is not None]
    start = router.expert_bias.detach().clone()
    applied = engine.train(_share(rank, None))
    after_applied = router.expert_bias.detach().clone()
    skipped = engine.train(_share(rank, nan_row=2))
    after_skipped = router.expert_bias.detach().clone()
    engine.train(_share(rank, None))
    return (applied["skipped_updates"], skipped["skipped_updates"], start, after_applied, after_skipped,
            router.expert_bias.detach().clone())


def test_a_skipped_update_leaves_the_routing_bias_where_it_was(tmp_path):
    model_dir = save_random(deepseek_v3_config(layers=2, first_k_dense_replace=1), tmp_path / "v3", seed=6)

    applied, skipped, start, after_applied, after_skipped, after_next = run_distributed(
        _skipped_update_rank, 2, model_dir, timeout=300)

    assert (applied, skipped) == (0, 1)
    assert not torch.equal(after_applied, start)  # an applied update moves the bias (the update is on)
    assert torch.equal(after_skipped, after_applied)  # the skipped one does not
    assert not torch.equal(after_next, after_skipped)  # and the next applied one moves it again

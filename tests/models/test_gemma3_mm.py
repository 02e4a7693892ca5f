"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration) as text-only policies (megarl/models/gemma3_mm.py):
log-probs as transformers' own multimodal class computes them on text, the convert round trip with the vision tower
carried bitwise, SGLang's names for the synced language model, the planner and the dry run on such a config.json."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
from megarl.models import get_family
from megarl.models.gemma3_mm import FAMILY as gemma3_mm
from megarl.reshard.inventory import hf_inventory
from tests.dist_utils import run_distributed
from tests.models.family_grpo import assert_text_only_grpo_keeps_the_tower
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import gemma3_mm_config, save_random
from tests.models.test_families_vs_hf import _exported, _relayout
from tests.test_convert import convert, round_trip

TOWER = ("vision_tower.", "multi_modal_projector.")


def language_tensors(model_dir) -> dict[str, torch.Tensor]:
    return {n: t for path in Path(model_dir).glob("*.safetensors") for n, t in load_file(path).items()
            if not n.startswith(TOWER)}


def _check_rank(rank, model_dir, saved, ref_logprobs, ref_entropy):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine

    checkpoint = language_tensors(model_dir)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        _relayout(tp, pp, 1)
        uneven = dict(pp_first_stage_layers=2, pp_last_stage_layers=1) if pp > 1 else {}
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, **uneven)
        # PP=2 starts from random weights and loads the checkpoint TP=2 saved
        # freeze_vision_tower (verl's key) holds by construction: the tower is never built
        actor = ActorConfig(parallel=parallel, micro_batch_size=2, freeze_vision_tower=tp == 1 and pp == 1)
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10, load_hf_weights=pp == 1)
        if pp > 1:
            engine.load_checkpoint(saved, optimizer=False)
        out = engine.compute_logprobs(padded_batch(), with_entropy=True)
        # fp32 sums in another order (TP's partial sums): a few ulps; a wrong mapping is off by 1e-3 or more
        for key, ref in (("logprobs", ref_logprobs), ("entropy", ref_entropy)):
            torch.testing.assert_close(out[key], ref, rtol=4e-6, atol=1e-5, msg=lambda m: f"tp={tp} pp={pp}: {key}: {m}")
        exported = _exported(engine)
        assert sorted(exported) == sorted(checkpoint), (tp, pp)
        assert all(torch.equal(exported[n], t) for n, t in checkpoint.items()), (tp, pp)
        if tp > 1:
            engine.save_checkpoint(saved)


def test_logprobs_match_transformers_multimodal_class_at_tp1_tp2_pp2(tmp_path):
    """transformers' Gemma3ForConditionalGeneration on text (fp32) and megarl's Megatron model of its language model
    at TP=1 (two data-parallel ranks), TP=2 (a vocabulary of 131 padded) and PP=2 (uneven stages of 2 and 1 layers, the
    tied embedding on both), the last from random weights and the checkpoint TP=2 saved (the tower's copy in it):
    log-probs and entropy alike, and the export is the checkpoint's language_model.model.* tensors bitwise (no head:
    tied)."""
    model_dir = save_random(gemma3_mm_config(), tmp_path / "gemma3_mm", seed=7)
    assert get_family(json.loads((tmp_path / "gemma3_mm" / "config.json").read_text())) is gemma3_mm
    saved = tmp_path / "checkpoint"
    run_distributed(_check_rank, 2, model_dir, str(saved), *hf_logprobs_entropy(model_dir, padded_batch()), timeout=240)
    assert load_file(saved / "hf" / "vision.safetensors").keys() == {
        n for n in load_file(f"{model_dir}/model.safetensors") if n.startswith(TOWER)}


def test_convert_round_trip_carries_the_tower_bitwise(tmp_path):
    """A bf16 Gemma3ForConditionalGeneration through `python -m megarl.convert` hf-to-megatron and megatron-to-hf:
    the language model and the untouched vision tower and projector bit for bit, config.json as it was (transformers
    loads a Gemma3ForConditionalGeneration from it), and import says that images are not used in training. The same
    checkpoint stored under transformers' in-memory names (model.language_model.* ...) comes back under the on-disk
    ones, every tensor bit for bit."""
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    fp32 = save_random(gemma3_mm_config(), tmp_path / "fp32", seed=8)
    hf = tmp_path / "hf"
    AutoModelForImageTextToText.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(hf)
    in_memory = tmp_path / "in_memory" / "hf"
    in_memory.mkdir(parents=True)
    (in_memory / "config.json").write_text((hf / "config.json").read_text())
    save_file({("model." + n.replace("language_model.model.", "language_model.", 1)): t
               for n, t in load_file(hf / "model.safetensors").items()}, str(in_memory / "model.safetensors"))
    log = convert(*round_trip(hf, tmp_path), *round_trip(in_memory, in_memory.parent), log=tmp_path / "convert.log")
    assert "Gemma3ForConditionalGeneration trained as a text-only policy: images are not used in training" in log
    assert "vision.safetensors" in {p.name for p in (tmp_path / "imported" / "actor" / "hf").iterdir()}

    original = load_file(hf / "model.safetensors")
    back = {n: t for path in (tmp_path / "back").glob("*.safetensors") for n, t in load_file(path).items()}
    assert any(n.startswith("vision_tower.") for n in back) and "lm_head.weight" not in back
    assert original.keys() == back.keys()
    assert all(original[n].dtype == back[n].dtype == torch.bfloat16 and torch.equal(original[n], back[n])
               for n in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "back")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    renamed = {n: t for path in (in_memory.parent / "back").glob("*.safetensors") for n, t in load_file(path).items()}
    assert renamed.keys() == original.keys() and all(torch.equal(original[n], renamed[n]) for n in original)


def test_sglang_names_and_the_synced_tensors(tmp_path, caplog):
    """The weight sync reaches SGLang's Gemma3ForConditionalGeneration (gemma3_mm.py: its language model's parameters
    are language_model.model.*, loaded through its Gemma3ForCausalLM's fused names) and the transformers engine by
    the checkpoint's names; the tower is neither listed nor sent, and the server starts as a text model."""
    from transformers import Gemma3ForConditionalGeneration

    from megarl.models.hf_checkpoint import SafetensorsCheckpoint
    from megarl.rollout.hf import checkpoint_views
    from megarl.rollout.sglang_layout import SGLangLayout, check_presharded_vocab
    from megarl.rollout.sglang_server import vision_args

    model_dir = save_random(gemma3_mm_config(), tmp_path / "gemma3_mm", seed=9)
    hf = json.loads((tmp_path / "gemma3_mm" / "config.json").read_text())
    specs = hf_inventory(hf)
    names = [s.name for s in specs]
    language = language_tensors(model_dir)
    assert sorted(names) == sorted(language)
    assert {s.name: s.shape for s in specs} == {n: tuple(t.shape) for n, t in language.items()}
    assert sorted(n for m in gemma3_mm.weight_maps(hf, 2) if m.export for n in m.hf) == sorted(names)
    with caplog.at_level(logging.WARNING, logger="megarl.models.hf_checkpoint"):
        assert sorted(SafetensorsCheckpoint(model_dir).shapes) == sorted(names)
    assert "multi_modal_projector.*, vision_tower.*" in caplog.text

    layout = SGLangLayout(specs, tp=2, hf=hf)
    check_presharded_vocab(specs, 2)
    for rank in range(2):
        assert layout.rows("language_model.model.embed_tokens.weight", rank) == (0, 131)
        assert layout.rows("language_model.model.layers.2.self_attn.q_proj.weight", rank) == (rank * 16, rank * 16 + 16)
        params = layout.parameters(rank)
        assert params[0] == "language_model.model.embed_tokens.weight" and params[-1] == "language_model.model.norm.weight"
        assert {p for p in params if ".layers.0." in p} == {f"language_model.model.layers.0.{n}" for n in (
            "input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
            "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "post_feedforward_layernorm.weight")}
    assert vision_args(model_dir, tp=2) == ([], {})

    views = checkpoint_views(Gemma3ForConditionalGeneration.from_pretrained(model_dir))
    assert set(names) <= set(views)
    assert all(torch.equal(views[n], t) for n, t in language.items())


def test_sync_into_the_transformers_engine_is_verified_with_the_tower_kept(tmp_path):
    """The transformers rollout engine holds the checkpoint's tensors under their checkpoint names (its model's
    model.language_model.* as language_model.model.*, the tower as vision_tower.*); a sync of the language model is
    verified by checksums, the tower's parameters (never sent) must be as they were, and a changed one is named."""
    from megarl.rollout.hf import HFRolloutEngine
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
    from megarl.utils.hf_config import TEXT_ONLY_TOWERS
    from megarl.workers.weight_sync import WeightSyncError, verify_checksums

    model_dir = save_random(gemma3_mm_config(), tmp_path / "gemma3_mm", seed=11)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    engine = HFRolloutEngine(model_dir, seed=0)
    held = engine.named_weights()
    assert held.keys() == checkpoint.keys() and all(torch.equal(held[n], checkpoint[n]) for n in checkpoint)

    hf = json.loads((tmp_path / "gemma3_mm" / "config.json").read_text())
    kept = TEXT_ONLY_TOWERS[hf["model_type"]]
    expected = ExpectedChecksums(layout_for(hf_inventory(hf), "hf"), [0])
    policy = {n: t + 0.25 for n, t in language_tensors(model_dir).items()}
    for name, tensor in policy.items():
        expected.add(name, tensor)
    engine.update_weights(policy.items())
    buffers = verify_checksums(expected.result(), engine.weight_checksums(), kept=kept)
    tower = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert (0, 0, tower) in buffers and torch.equal(engine.named_weights()[tower], checkpoint[tower])
    with pytest.raises(WeightSyncError, match=r"23 held but never sent \['server 0 rank 0: vision_tower\."):
        verify_checksums(expected.result(), engine.weight_checksums())
    with torch.no_grad():
        engine.model.model.vision_tower.encoder.layers[0].mlp.fc1.weight.add_(1.0)
    with pytest.raises(WeightSyncError, match=rf"unsynced parameter {tower} \(changed since the first verification"):
        verify_checksums(expected.result(), engine.weight_checksums(), buffers, kept)


def test_prompts_with_images_are_refused_naming_text_only_training(tmp_path):
    from megarl.config.tiny import tiny_config
    from megarl.data.files import InputError
    from megarl.data.inputs import image_prompts

    model_dir = save_random(gemma3_mm_config(), tmp_path / "gemma3_mm", seed=12)
    rows = [{"prompt": "<image>how many?", "images": ["a.png"], "answer": "1"}]
    with pytest.raises(InputError, match=r"model_type gemma3\) trains as a text-only policy: images are not used"):
        image_prompts(tiny_config([f"model.path={model_dir}"]), None, rows)


def test_grpo_steps_at_tp2_keep_the_tower(tmp_path, ray_local):
    """GRPO end to end on the CPU at TP=2: the transformers rollout engine generates with the multimodal class on text,
    every sync into it is verified (the tower's parameters, never sent, checked unchanged), the engine ends up holding
    the trained language model, and the step's checkpoint keeps the tower's copy for export."""
    assert_text_only_grpo_keeps_the_tower(gemma3_mm_config, tmp_path / "gemma3_mm", tmp_path / "run", TOWER,
                                          ["actor.parallel.tp=2"], seed=5)


def test_untied_head_is_refused_by_key():
    hf = gemma3_mm_config().to_dict() | {"tie_word_embeddings": False}
    with pytest.raises(ValueError, match="tie_word_embeddings=false is not supported"):
        gemma3_mm.transformer_config(hf, tp=1, pp=1, params_dtype=torch.float32, use_cpu_initialization=True)


def test_published_4b_config_plans_as_its_language_model(capsys):
    """google/gemma-3-4b-it's config.json (its text_config names few fields: the rest are Gemma3TextConfig's
    defaults) plans as the 4B's language model: the same tensors under language_model.model.*, 3.88B parameters;
    context parallelism refused as for the text model."""
    from megarl.reshard.plan import load_model_config, main
    from megarl.utils.hf_config import parallel_limit

    hf, text = load_model_config("gemma-3-4b-it"), load_model_config("gemma-3-4b")
    assert [(s.name, s.shape) for s in hf_inventory(hf)] == [
        ("language_model." + s.name, s.shape) for s in hf_inventory(text)]
    config = gemma3_mm.transformer_config(hf, tp=2, pp=1, params_dtype=torch.float32, use_cpu_initialization=True)
    assert (config.num_layers, config.num_attention_heads, config.num_query_groups, config.kv_channels) == (34, 8, 4, 256)
    assert gemma3_mm.gpt_model_kwargs(hf, 1)["seq_len_interpolation_factor"] == 8.0
    assert "cp=1 only" in parallel_limit(hf, tp=1, etp=1, cp=2)
    main(["--model", "gemma-3-4b-it", "--train", "tp=2", "--gen", "tp=2"])
    out = capsys.readouterr().out
    assert out.startswith("gemma-3-4b-it: 3.88B parameters") and "vision tower is neither trained nor synced" in out


def test_dry_run_accepts_the_multimodal_checkpoint(tmp_path, capsys):
    from megarl.config.tiny import TINY_ARGS
    from megarl.models.tiny import build_char_tokenizer
    from megarl.train import main

    model_dir = save_random(gemma3_mm_config(), tmp_path / "gemma3_mm", seed=10)
    build_char_tokenizer().save_pretrained(model_dir)
    assert main(["--dry-run", *TINY_ARGS, f"model.path={model_dir}", "rollout.engine=sglang",
                 "actor.parallel.world_size=2", "actor.parallel.tp=2", "rollout.sglang_tp=2"]) == 0
    assert "config ok: world_size=2 = tp 2" in capsys.readouterr().out

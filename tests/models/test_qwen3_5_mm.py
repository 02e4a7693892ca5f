"""Qwen3.5's published checkpoints (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration) as text-only
policies (megarl/models/qwen3_5_mm.py): log-probs as transformers' own multimodal classes compute them on text, the
convert round trip with the vision tower carried bitwise, SGLang's names for the synced language model, the planner
and the dry run on such a config.json, prompts with images refused."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
from megarl.models import get_family
from megarl.models.qwen3_5_mm import FAMILY as qwen3_5_mm, MOE_FAMILY as qwen3_5_moe_mm
from megarl.reshard.inventory import hf_inventory
from tests.dist_utils import run_distributed
from tests.models.family_grpo import assert_text_only_grpo_keeps_the_tower
from tests.engine.hf_models import padded_batch
from tests.models.hf_families import MODEL_CLASSES, qwen3_5_mm_config, save_random
from tests.models.test_families_vs_hf import _exported, _relayout
from tests.test_convert import convert, round_trip

TOWER = "model.visual."


def language_tensors(model_dir) -> dict[str, torch.Tensor]:
    return {n: t for path in Path(model_dir).glob("*.safetensors") for n, t in load_file(path).items()
            if not n.startswith(TOWER)}


@torch.no_grad()
def multimodal_logprobs_entropy(model_dir: str, architecture: str):
    """transformers' ConditionalGeneration class on text (float32): log p(tokens[t] | <t) and entropy, 0 at t=0 and
    padding (AutoModelForCausalLM would build the text class from this directory, an untied head left random)."""
    model = MODEL_CLASSES[architecture].from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = padded_batch()
    tokens, mask = batch["tokens"], batch["attention_mask"]
    logp = torch.log_softmax(model(input_ids=tokens, attention_mask=mask).logits.float()[:, :-1], -1)
    lp, ent = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    real, pad = mask[:, 1:] > 0, torch.nn.functional.pad
    return pad(torch.where(real, lp, 0.0), (1, 0)), pad(torch.where(real, ent, 0.0), (1, 0))


def _check_rank(rank, cases):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine

    _relayout(1, 1, 1)
    parallel = ParallelConfig(world_size=dist.get_world_size())
    for model_dir, ref_logprobs, ref_entropy in cases:
        engine = MegatronEngine(model_dir, ActorConfig(parallel=parallel, micro_batch_size=2, freeze_vision_tower=True),
                                AlgorithmConfig(), "cpu", 1, 10)
        out = engine.compute_logprobs(padded_batch(), with_entropy=True)
        for key, ref in (("logprobs", ref_logprobs), ("entropy", ref_entropy)):
            torch.testing.assert_close(out[key], ref, rtol=4e-6, atol=1e-5, msg=lambda m: f"{model_dir}: {key}: {m}")
        exported, checkpoint = _exported(engine), language_tensors(model_dir)
        assert sorted(exported) == sorted(checkpoint), model_dir
        assert all(torch.equal(exported[n], t) for n, t in checkpoint.items()), model_dir


def test_logprobs_match_transformers_multimodal_classes(tmp_path):
    """The dense (tied head) and MoE (untied) checkpoints at DP=2: megarl's Megatron model of the language model gives
    transformers' ConditionalGeneration log-probs and entropy on text, and its export is the checkpoint's
    model.language_model.* (and lm_head) tensors bitwise."""
    cases = []
    for moe, family in ((False, qwen3_5_mm), (True, qwen3_5_moe_mm)):
        config = qwen3_5_mm_config(moe)
        model_dir = save_random(config, tmp_path / f"moe_{moe}", seed=21)
        assert get_family(json.loads((tmp_path / f"moe_{moe}" / "config.json").read_text())) is family
        cases.append((model_dir, *multimodal_logprobs_entropy(model_dir, config.architectures[0])))
    run_distributed(_check_rank, 2, cases, timeout=240)


@pytest.mark.parametrize("moe", [False, True])
def test_convert_round_trip_carries_the_tower_bitwise(moe, tmp_path):
    """A bf16 checkpoint through `python -m megarl.convert` hf-to-megatron and megatron-to-hf: the language model and
    the untouched tower bit for bit, config.json as it was (transformers loads the ConditionalGeneration class from
    it), and import says that images are not used in training. The MoE's experts stacked as its releases store them
    are read too, and come back as one tensor per expert (transformers' save_pretrained names), bit for bit."""
    from transformers import AutoModelForImageTextToText

    config = qwen3_5_mm_config(moe)
    hf = tmp_path / "hf"
    MODEL_CLASSES[config.architectures[0]].from_pretrained(save_random(config, tmp_path / "fp32", seed=22),
                                                           dtype=torch.bfloat16).save_pretrained(hf)
    stacked = tmp_path / "stacked" / "hf"
    if moe:  # the published spelling: each layer's experts stacked, output-major
        stacked.mkdir(parents=True)
        (stacked / "config.json").write_text((hf / "config.json").read_text())
        save_file(stack_experts(load_file(hf / "model.safetensors"), experts=3), str(stacked / "model.safetensors"))
    log = convert(*round_trip(hf, tmp_path), *(round_trip(stacked, stacked.parent) if moe else ()),
                  log=tmp_path / "convert.log")
    assert f"{config.architectures[0]} trained as a text-only policy: images are not used in training" in log
    kept = load_file(tmp_path / "imported" / "actor" / "hf" / "vision.safetensors")
    original = load_file(hf / "model.safetensors")
    assert kept.keys() == {n for n in original if n.startswith(TOWER)} and kept
    back = {n: t for path in (tmp_path / "back").glob("*.safetensors") for n, t in load_file(path).items()}
    assert original.keys() == back.keys() and ("lm_head.weight" in back) == moe
    assert all(original[n].dtype == back[n].dtype == torch.bfloat16 and torch.equal(original[n], back[n])
               for n in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "back")).__name__ == config.architectures[0]
    if moe:  # read per expert; written back as save_pretrained writes it, every value bitwise
        unstacked = {n: t for path in (stacked.parent / "back").glob("*.safetensors") for n, t in load_file(path).items()}
        assert unstacked.keys() == original.keys() and all(torch.equal(original[n], unstacked[n]) for n in original)


def stack_experts(tensors: dict, experts: int) -> dict:
    """A checkpoint's per-expert tensors stacked as Qwen3.5-MoE's releases store them: experts.gate_up_proj
    [E, 2 x width, hidden] (gate rows, then up rows) and experts.down_proj [E, hidden, width]."""
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    for prefix in {n.split("experts.")[0] + "experts." for n in tensors if ".mlp.experts." in n}:
        def proj(e, p):
            return tensors[f"{prefix}{e}.{p}_proj.weight"]
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([proj(e, "gate"), proj(e, "up")]) for e in range(experts)])
        out[prefix + "down_proj"] = torch.stack([proj(e, "down") for e in range(experts)])
    return out


def test_sglang_names_of_the_conditional_generation_class(tmp_path):
    """SGLang's Qwen3_5(Moe)ForConditionalGeneration loads model.language_model.* as its model.* (the attention
    without self_attn., the gated delta net's projections fused in in_proj_qkvz / in_proj_ba), the head as lm_head;
    the tower is neither listed nor sent, and the server starts as a text model."""
    from megarl.rollout.sglang_layout import SGLangLayout, check_hybrid_rollout
    from megarl.rollout.sglang_server import vision_args
    from megarl.utils.hf_config import language_fields

    for moe in (False, True):
        model_dir = save_random(qwen3_5_mm_config(moe), tmp_path / f"moe_{moe}", seed=23)
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        specs = hf_inventory(hf)
        language = language_tensors(model_dir)
        assert {s.name: s.shape for s in specs} == {n: tuple(t.shape) for n, t in language.items()}
        layout = SGLangLayout(specs, tp=2, hf=hf, sglang_args=["--disable-shared-experts-fusion"])
        params = layout.parameters(0)
        assert params[0] == "model.embed_tokens.weight" and not any("visual" in p or "language_model" in p
                                                                    for p in params)
        layer = {p for p in params if p.startswith("model.layers.")}
        assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
                "model.layers.1.qkv_proj.weight", "model.layers.1.o_proj.weight"} <= layer
        assert ("lm_head.weight" in params) == moe
        assert layout.place("model.language_model.layers.1.self_attn.o_proj.weight", 0)[0] == \
            "model.layers.1.o_proj.weight"
        assert vision_args(model_dir, tp=2) == ([], {})
        assert check_hybrid_rollout(language_fields(hf), 2, "sharded") is not None  # as for the text models


def test_sync_into_the_transformers_engine_is_verified_with_the_tower_kept(tmp_path):
    """The transformers rollout engine (the ConditionalGeneration class) holds the checkpoint's tensors under their
    names (the MoE's experts, fused in memory, as the checkpoint's per-expert ones); a sync of the language model is
    verified by checksums, and the tower's parameters, never sent, must be as they were."""
    from transformers import GenerationConfig

    from megarl.rollout.hf import HFRolloutEngine
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
    from megarl.utils.hf_config import TEXT_ONLY_TOWERS
    from megarl.workers.weight_sync import WeightSyncError, verify_checksums

    for moe in (False, True):
        model_dir = save_random(qwen3_5_mm_config(moe), tmp_path / f"moe_{moe}", seed=26)
        GenerationConfig(eos_token_id=1, pad_token_id=0).save_pretrained(model_dir)
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        engine = HFRolloutEngine(model_dir, seed=0)
        language = language_tensors(model_dir)
        held = engine.named_weights()
        assert all(torch.equal(held[n], t) for n, t in language.items())
        expected = ExpectedChecksums(layout_for(hf_inventory(hf), "hf"), [0])
        policy = {n: t + 0.25 for n, t in language.items()}
        for name, tensor in policy.items():
            expected.add(name, tensor)
        engine.update_weights(policy.items())
        kept = TEXT_ONLY_TOWERS[hf["model_type"]]
        buffers = verify_checksums(expected.result(), engine.weight_checksums(), kept=kept)
        assert any(name.startswith(TOWER) for _, _, name in buffers)
        with torch.no_grad():
            next(p for n, p in engine.model.named_parameters() if n.startswith(TOWER)).add_(1.0)
        with pytest.raises(WeightSyncError, match=r"unsynced parameter model\.visual\."):
            verify_checksums(expected.result(), engine.weight_checksums(), buffers, kept)


def test_grpo_steps_keep_the_tower(tmp_path, ray_local):
    """GRPO end to end on the CPU with the dense checkpoint (tied head) at PP=2: the transformers rollout engine
    generates with Qwen3_5ForConditionalGeneration on text, every sync into it is verified (the tower's parameters,
    never sent, checked unchanged), the engine ends up holding the trained language model, and the step's checkpoint
    keeps the tower's copy."""
    assert_text_only_grpo_keeps_the_tower(qwen3_5_mm_config, tmp_path / "qwen3_5", tmp_path / "run", TOWER,
                                          ["actor.parallel.pp=2"], seed=27)


def test_published_config_plans_and_dry_runs(tmp_path, capsys):
    """A config.json as the releases write it (text_config with interleaved M-RoPE sections) builds, plans as its
    language model and passes the dry run."""
    from megarl.config.tiny import TINY_ARGS
    from megarl.models.tiny import build_char_tokenizer
    from megarl.reshard.plan import main as plan
    from megarl.train import main

    model_dir = save_random(qwen3_5_mm_config(moe=True), tmp_path / "moe", seed=24)
    path = Path(model_dir) / "config.json"
    hf = json.loads(path.read_text())
    hf["text_config"]["rope_parameters"] |= {"mrope_interleaved": True, "mrope_section": [1, 0, 0]}
    path.write_text(json.dumps(hf))
    config = qwen3_5_moe_mm.transformer_config(hf, tp=1, pp=1, params_dtype=torch.float32, use_cpu_initialization=True)
    assert (config.num_layers, config.num_moe_experts) == (2, 3)
    assert qwen3_5_moe_mm.gpt_model_kwargs(hf, 1)["rotary_percent"] == 0.25
    plan(["--model", str(path), "--train", "tp=1,pp=2,dp=1", "--gen", "tp=2"])
    assert "vision tower is neither trained nor synced" in capsys.readouterr().out
    build_char_tokenizer().save_pretrained(model_dir)
    assert main(["--dry-run", *TINY_ARGS, f"model.path={model_dir}", "rollout.engine=sglang",
                 "rollout.sglang_args=[--disable-shared-experts-fusion]"]) == 0
    assert "config ok" in capsys.readouterr().out


def test_prompts_with_images_are_refused_naming_text_only_training(tmp_path):
    from megarl.config.tiny import tiny_config
    from megarl.data.files import InputError
    from megarl.data.inputs import image_prompts

    model_dir = save_random(qwen3_5_mm_config(), tmp_path / "qwen3_5", seed=25)
    rows = [{"prompt": "<image>how many?", "images": ["a.png"], "answer": "1"}]
    with pytest.raises(InputError, match=r"model_type qwen3_5\) trains as a text-only policy: images are not used"):
        image_prompts(tiny_config([f"model.path={model_dir}"]), None, rows)

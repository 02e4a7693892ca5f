"""The policy's LoRA adapters as a PEFT directory (megarl/engine/lora_peft.py, `python -m megarl.convert
megatron-to-peft`): peft loads it onto transformers' model and its logits are those of megarl's merged weights (fp32),
written at TP=2 and at TP=1 alike, and from a checkpoint by the convert command; written at PP=2 (the stages'
adapters gathered) and from a PP=2 checkpoint, peft's log-probs are the trainer's; the hf rollout engine's
adapter-only sync gives the rollouts of a merged sync."""

import json
import subprocess
import sys
import zlib

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.config import ActorConfig, AlgorithmConfig
from megarl.config.sections import LoraConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])


def _engine_with_random_adapters(model_dir: str):
    """A LoRA engine whose adapters are random (B non-zero), the same whole matrices at any TP and PP (drawn by the
    parameter's global name: each pipeline stage's layers their own)."""
    from megatron.core import parallel_state

    from megarl.engine import MegatronEngine, weights

    engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=8, lora=LORA), AlgorithmConfig(), "cpu", 1, 10)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in weights.global_parameters(engine.gpts).items():
            if ".lora." not in name:
                continue
            split = getattr(p, "tensor_model_parallel", False)
            shape = [n * (tp if split and d == p.partition_dim else 1) for d, n in enumerate(p.shape)]
            full = 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            p.copy_(full.chunk(tp, p.partition_dim)[rank] if split else full)
    return engine


def _export_rank(rank, model_dir, out, staging, batch):
    """The adapters written as PEFT directories at TP=2, TP=1 and PP=2 (the stages' adapters gathered); the merged
    export at TP=2 and TP=1; at PP=2 a checkpoint and the trainer's log-probs."""
    from megatron.core import parallel_state

    from megarl.engine.lora_peft import save_peft
    from megarl.parallel.state import build_model_parallel

    merged = {}
    for tp, pp in ((2, 1), (1, 1), (1, 2)):
        if (tp, pp) != (2, 1):
            parallel_state.destroy_model_parallel()
            build_model_parallel(tp, pp, 1)  # TP=1: two data-parallel ranks; PP=2: one layer a stage
        engine = _engine_with_random_adapters(model_dir)
        assert save_peft(engine, f"{out}/{'pp2' if pp == 2 else f'tp{tp}'}", model_dir) > 0
        if pp == 1:
            merged[tp] = {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    engine.save_checkpoint(f"{staging}/actor")
    return merged, engine.compute_logprobs(batch)["logprobs"]


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits


def test_peft_export_gives_the_merged_policy_at_tp2_tp1_and_pp2_from_a_checkpoint_and_to_the_rollout_engine(
        tmp_path):
    from megarl.engine.checkpoint_dir import publish
    from tests.engine.test_lora import _aligned_logprobs

    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    config = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps(config | {"eos_token_id": 0}))  # the hf engine's stop
    batch = padded_batch()
    merged, trainer_logprobs = run_distributed(_export_rank, 2, model_dir, str(tmp_path), str(tmp_path / "staging"),
                                               batch, tp=2)
    publish(tmp_path / "staging", tmp_path / "ckpt", step=1, driver_state=None)
    # the convert command loads the PP=2 checkpoint in one process (PP=1)
    command = [sys.executable, "-m", "megarl.convert", "megatron-to-peft", str(tmp_path / "ckpt"),
               str(tmp_path / "converted"), "--device", "cpu"]
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True)  # no model.path recorded: --base
    assert refused.returncode == 2 and "name the base model with --base" in refused.stderr, refused.stderr
    done = subprocess.run(command + ["--base", model_dir], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    base_logits = _logits(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), batch)
    tp2 = load_file(f"{tmp_path}/tp2/adapter_model.safetensors")
    assert len(tp2) == 2 * 6 * 2  # 2 layers x 6 projections x (A, B)
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in tp2
    # gathered at TP=2 as held whole at TP=1, gathered from both stages at PP=2, and as the checkpoint kept them
    for other in ("tp1", "pp2", "converted"):
        written = load_file(f"{tmp_path}/{other}/adapter_model.safetensors")
        assert sorted(written) == sorted(tp2) and all(torch.equal(written[k], tp2[k]) for k in tp2), other
    config = json.loads((tmp_path / "converted" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, model_dir)
    assert config["target_modules"] == sorted(LORA.target_modules)
    for tp in (2, 1):
        assert torch.equal(merged[tp]["model.embed_tokens.weight"], load_file(f"{model_dir}/model.safetensors")[
            "model.embed_tokens.weight"])
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                         f"{tmp_path}/tp{tp}")
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(merged[tp], strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        want = _logits(plain, batch)
        assert (want - base_logits).abs().max() > 1e-2  # the adapters change the policy
        # W x + s B (A x) against (W + s B A) x: fp32 sums in another order
        torch.testing.assert_close(_logits(peft, batch), want, rtol=0, atol=5e-5)
    # peft's model from the converted PP=2 checkpoint: the log-probs the trainer computed at PP=2
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                     f"{tmp_path}/converted")
    with torch.no_grad():
        torch.testing.assert_close(_aligned_logprobs(peft, batch), trainer_logprobs, rtol=0, atol=2e-5)
    _check_adapter_sync(model_dir, f"{tmp_path}/tp2", merged[2])


def _check_adapter_sync(model_dir: str, adapter: str, merged: dict):
    """The hf rollout engine after an adapter-only sync (rollout.lora_sync=adapter: the PEFT directory merged onto
    its base) holds the merged sync's weights bit for bit and generates its greedy rollouts; syncing twice merges
    onto the base, not onto the last merge."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    by_adapter, by_merge = HFRolloutEngine(model_dir, adapters=True), HFRolloutEngine(model_dir)
    by_adapter.load_lora_adapter(adapter)
    by_adapter.release_memory()  # adapter syncs send no base weights: they stay
    by_adapter.load_lora_adapter(adapter)
    by_merge.update_weights(merged.items())
    held, want = by_adapter.named_weights(), by_merge.named_weights()
    assert sorted(held) == sorted(want) and all(torch.equal(held[n], want[n]) for n in want)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, n=1, ignore_eos=True)
    prompts = [[1, 5, 9, 2], [7, 3]]
    got, expected = by_adapter.generate(prompts, params), by_merge.generate(prompts, params)
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    assert [g.logprobs for g in got] == [g.logprobs for g in expected]
    base = HFRolloutEngine(model_dir).generate(prompts, params)
    assert [g.logprobs for g in base] != [g.logprobs for g in got]

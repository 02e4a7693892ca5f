"""Megatron policy at TP=2 x PP=2 (4 gloo ranks) against transformers' Qwen2ForCausalLM on the same
checkpoint: log-probs and entropy, and the weights exported back to HF names."""

import torch
from safetensors.torch import load_file

from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch
from megarl.config import ActorConfig, AlgorithmConfig
from tests.dist_utils import run_distributed

BUCKET_BYTES = 5000


def _check_rank(rank, cases):
    from megarl.engine import MegatronEngine

    for model_dir, ref_logprobs, ref_entropy in cases:
        engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=2), AlgorithmConfig(), "cpu", 1, 10)
        out = engine.compute_logprobs(padded_batch(), with_entropy=True)
        # Every rank (both TP ranks of both stages) returns the result.
        torch.testing.assert_close(out["logprobs"], ref_logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(out["entropy"], ref_entropy, rtol=0, atol=1e-5)
        exported = {}
        for bucket in engine.export_hf_weights(BUCKET_BYTES):
            assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET_BYTES
            exported.update(bucket)
        checkpoint = load_file(f"{model_dir}/model.safetensors")
        assert sorted(exported) == sorted(checkpoint)
        for name, tensor in checkpoint.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    return True


def test_logprobs_entropy_and_export_match_hf_at_tp2_pp2(tmp_path):
    cases = []
    for tied in (True, False):
        model_dir = make_qwen2_dir(tmp_path / f"tied{tied}", tied=tied)
        ref_logprobs, ref_entropy = hf_logprobs_entropy(model_dir, padded_batch())
        assert ref_logprobs.abs().sum() > 0 and (ref_logprobs[padded_batch()["attention_mask"] == 0] == 0).all()
        cases.append((model_dir, ref_logprobs, ref_entropy))
    assert "lm_head.weight" not in load_file(f"{cases[0][0]}/model.safetensors")  # tied: no separate head
    assert run_distributed(_check_rank, 4, cases, tp=2, pp=2)

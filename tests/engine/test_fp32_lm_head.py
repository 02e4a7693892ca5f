"""actor.fp32_lm_head on both sides: the Megatron engine's output layer runs in float32 under bf16 and trains
(the weight gradient reaches the bf16 parameter, tied to the embedding); the hf engine's lm_head returns float32
logits; SGLang servers get --enable-fp32-lm-head, which rollout.sglang_args may not name. (That the float32 head
brings bf16 log-probs closer to float32 ones: tests/real_model/test_logprobs.py, on a real model.)"""

import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig, ConfigError, OptimConfig
from megarl.config.tiny import tiny_config
from megarl.models.tiny import build_tiny_model
from megarl.rollout.sglang_server import sglang_server
from tests.conftest import QUICKSTART
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch

FLAG = "--enable-fp32-lm-head"


def _train_step(rank, model_dir):
    from megarl.engine import MegatronEngine

    out = {}
    for fp32_lm_head in (False, True):
        actor = ActorConfig(precision="bf16", fp32_lm_head=fp32_lm_head, micro_batch_size=5,
                            optim=OptimConfig(lr=1e-2, clip_grad=1.0))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(kl_coef=0.0), "cpu", 1, 10)
        logits = []
        engine.gpt.output_layer.register_forward_hook(lambda m, args, output: logits.append(output[0].dtype))
        batch = padded_batch()
        batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
        batch["advantages"] = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(0))
        before = engine.gpt.embedding.word_embeddings.weight.detach().clone()
        loss = engine.train(batch)["loss"]
        after = engine.gpt.embedding.word_embeddings.weight.detach()
        out[fp32_lm_head] = (logits[0], loss, before.dtype, (after.float() - before.float()).abs().max().item())
    return out


def test_megatron_output_layer_in_float32_trains(tmp_path):
    out = run_distributed(_train_step, 1, make_qwen2_dir(tmp_path / "model", tied=True))
    assert out[False][0] == torch.bfloat16 and out[True][0] == torch.float32
    for logits_dtype, loss, weight_dtype, change in out.values():
        assert weight_dtype == torch.bfloat16 and torch.isfinite(torch.tensor(loss)) and change > 0
    assert abs(out[True][1] - out[False][1]) < 0.05  # the same loss up to bf16 rounding


def _logprobs(rank, model_dir):
    from megarl.engine import MegatronEngine

    out = {}
    for precision, fp32_lm_head in (("fp32", False), ("bf16", False), ("bf16", True)):
        actor = ActorConfig(precision=precision, fp32_lm_head=fp32_lm_head, micro_batch_size=5)
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(kl_coef=0.0), "cpu", 1, 1, trainable=False)
        out[precision, fp32_lm_head] = engine.compute_logprobs(padded_batch())["logprobs"]
    return out


def test_bf16_logprobs_move_towards_fp32_with_the_float32_head(tmp_path):
    """Where the output layer's rounding is the whole distance to fp32: weights exactly representable in bf16 (only
    the arithmetic differs), layers that add nothing to the residual stream (o_proj and down_proj zero: the decoder's
    own bf16 rounding gone), logits of magnitude ~10-30 (bf16's spacing there 0.0625-0.125)."""
    from safetensors.torch import load_file, save_file

    model_dir = make_qwen2_dir(tmp_path / "model", tied=False)
    scale = {"lm_head.weight": 16, "o_proj.weight": 0, "down_proj.weight": 0}
    weights = {name: t.to(torch.bfloat16).float() * next((v for k, v in scale.items() if name.endswith(k)), 1)
               for name, t in load_file(f"{model_dir}/model.safetensors").items()}
    save_file(weights, f"{model_dir}/model.safetensors", metadata={"format": "pt"})
    out = run_distributed(_logprobs, 1, model_dir)
    real = padded_batch()["attention_mask"] > 0
    real[:, 0] = False
    error = {head: (out["bf16", head] - out["fp32", False])[real].abs().mean().item() for head in (False, True)}
    assert error[True] < 0.6 * error[False], error  # measured 0.121 -> 0.050 (what is left: the final norm's rounding)


def test_hf_engine_lm_head_in_float32(tmp_path):
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    model_dir = str(build_tiny_model(tmp_path / "model"))  # tied embeddings, a tokenizer and generation config
    plain = HFRolloutEngine(model_dir, dtype=torch.bfloat16)
    hidden = torch.randn(2, plain.model.config.hidden_size, dtype=torch.bfloat16)
    assert plain.model.get_output_embeddings()(hidden).dtype == torch.bfloat16
    engine = HFRolloutEngine(model_dir, dtype=torch.bfloat16, fp32_lm_head=True)
    head = engine.model.get_output_embeddings()
    expected = hidden.float() @ head.weight.float().T
    assert torch.equal(head(hidden), expected) and head.weight.dtype == torch.bfloat16
    assert head.weight is engine.model.get_input_embeddings().weight  # still tied: weight updates reach both
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))[0].token_ids) > 0


def test_sglang_servers_get_the_flag_and_sglang_args_may_not_name_it(tmp_path):
    assert FLAG not in sglang_server("model", log_dir=str(tmp_path)).command
    assert FLAG in sglang_server("model", fp32_lm_head=True, log_dir=str(tmp_path)).command
    with pytest.raises(ConfigError, match=f"{FLAG} is set by megarl .*actor.fp32_lm_head"):
        tiny_config(["rollout.engine=sglang", f"rollout.sglang_args=[{FLAG}]"], path=QUICKSTART)

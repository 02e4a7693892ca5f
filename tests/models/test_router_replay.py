"""Rollout routing replay (actor.router_replay=rollout) on a tiny Qwen3-MoE (2 layers, 4 experts, top-2):

- megatron's routers route every token to the experts the batch records, in the log-prob forward and the training
  forward, through one_row packing's reordering: the experts recorded are chosen at random (so they differ from the
  trainer's own choice), read back from the routers' routing maps, and the log-probs equal transformers' with its
  gates forced to those experts; without replay neither holds; the same log-probs at TP=2 with sequence parallelism
  and at EP=2;
- the hf rollout engine's record equals transformers' own routing (output_router_logits) of the tokens it generated,
  and a gate that returns no expert indices (DeepSeek-V3's) is refused;
- a dense model is refused by name; Batch.concat pads the record's token dimension;
- the same for a tiny Qwen3-Next (models/qwen3_next.py: the same router and gate outputs, beside a shared expert and
  gated delta nets): megatron replays the record to transformers' forced log-probs, and the hf engine records its
  routing."""

import pytest
import torch
import torch.nn.functional as F

from megarl.config import ActorConfig, AlgorithmConfig, ConfigError, OptimConfig
from megarl.config.model_layout import check_model_layout
from megarl.protocol import Batch
from tests.dist_utils import run_distributed
from tests.engine.hf_models import padded_batch
from tests.models.hf_families import qwen3_moe_config, qwen3_next_config, save_random

LAYERS, EXPERTS, TOPK = 2, 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    config = qwen3_moe_config(tied=False, norm_topk_prob=True)
    config.eos_token_id = 100  # the hf rollout engine's stop token
    return save_random(config, tmp_path_factory.mktemp("moe"), seed=3)


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    config = qwen3_next_config()  # LAYERS, EXPERTS and TOPK as the Qwen3-MoE's
    config.eos_token_id = 100
    return save_random(config, tmp_path_factory.mktemp("next"), seed=3)


def recorded_batch() -> Batch:
    batch = padded_batch(rows=6)
    g = torch.Generator().manual_seed(9)
    B, T = batch["tokens"].shape
    batch["routed_experts"] = torch.rand(B, T, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK].to(torch.int16)
    batch["routed_experts"][:, -1] = -1  # a token without a record routes by the router's own choice
    return batch


@torch.no_grad()
def forced_hf_logprobs(model_dir: str, batch: Batch) -> torch.Tensor:
    """transformers' log-probs with every gate routing token t of row b to routed_experts[b, t, layer] (its own
    choice where the record is -1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routed = batch["routed_experts"].long()

    def forced(layer):
        def hook(gate, args, output):
            logits, _, own = output
            target = routed[:, :, layer].reshape(-1, TOPK)
            indices = torch.where((target >= 0).all(-1, keepdim=True), target, own)
            weights = F.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
            weights = weights / weights.sum(-1, keepdim=True)  # norm_topk_prob
            return logits, weights.to(logits.dtype), indices
        return hook

    for layer, block in enumerate(model.model.layers):
        block.mlp.gate.register_forward_hook(forced(layer))
    tokens, mask = batch["tokens"], batch["attention_mask"]
    logp = torch.log_softmax(model(input_ids=tokens, attention_mask=mask).logits.float()[:, :-1], -1)
    lp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(torch.where(mask[:, 1:] > 0, lp, 0.0), (1, 0))


def _routing_rank(rank, model_dir):
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.engine import MegatronEngine

    out = {}
    for replay in ("rollout", "off"):
        actor = ActorConfig(router_replay=replay, micro_batch_size=2, max_tokens_per_micro_batch=24,
                            optim=OptimConfig(lr=1e-3))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        maps, mbs = [], []
        routers = [m for m in engine.gpt.modules() if isinstance(m, TopKRouter)]
        for layer, router in enumerate(routers):
            router.register_forward_hook(lambda m, a, o, layer=layer: maps.append((layer, o[1].detach().clone())))
        run = engine._run_schedule
        engine._run_schedule = lambda m, fn, forward_only: mbs.append(m) or run(m, fn, forward_only)
        batch = recorded_batch()
        logprobs = engine.compute_logprobs(batch)["logprobs"]
        engine.train(batch, loss="sft")
        out[replay] = (logprobs, [(mb["seq_index"], mb["packed_index"], mb["tokens"].shape) for m in mbs for mb in m],
                       maps)
    return out


def _routed_sets(batch: Batch, packings, maps) -> tuple[int, int]:
    """(tokens whose routing map equals the record, tokens compared), over every recorded real token of every
    forward (each micro-batch's routers fire once per layer, in order)."""
    lengths = batch["attention_mask"].sum(1)
    equal = compared = 0
    per_forward = [maps[i:i + LAYERS] for i in range(0, len(maps), LAYERS)]
    assert len(per_forward) == len(packings)
    for (seq_index, packed_index, (rows, width)), layer_maps in zip(packings, per_forward):
        for layer, routing_map in layer_maps:
            for s, b in enumerate(seq_index.tolist()):
                for t in range(int(lengths[b]) - 1):  # the batch's last column has no record
                    p = int(packed_index[s, t])
                    chosen = routing_map[(p % width) * rows + p // width].nonzero().flatten().sort().values
                    recorded = batch["routed_experts"][b, t, layer].long().sort().values
                    equal += torch.equal(chosen, recorded)
                    compared += 1
    return equal, compared


def test_megatron_routes_the_recorded_experts(moe_dir):
    out = run_distributed(_routing_rank, 1, moe_dir, timeout=300)
    batch = recorded_batch()
    reference = forced_hf_logprobs(moe_dir, batch)

    logprobs, packings, maps = out["rollout"]
    assert len(packings) >= 4  # log-prob and training forwards, several micro-batches each
    equal, compared = _routed_sets(batch, packings, maps)
    assert compared > 100 and equal == compared
    torch.testing.assert_close(logprobs, reference, rtol=0, atol=1e-5)

    logprobs, packings, maps = out["off"]  # the trainer's own routing: other experts, other log-probs
    equal, compared = _routed_sets(batch, packings, maps)
    assert equal < compared // 2
    assert (logprobs - reference).abs().max() > 1e-2


def _layouts_rank(rank, model_dir):
    from megatron.core import parallel_state as ps

    from megarl.config import ParallelConfig
    from megarl.engine import MegatronEngine
    from megarl.parallel.state import build_model_parallel

    out = {}
    for tp, ep, sp in ((2, 1, True), (1, 2, False)):
        ps.destroy_model_parallel()
        build_model_parallel(tp, 1, seed=1, ep=ep)
        actor = ActorConfig(router_replay="rollout", micro_batch_size=2, max_tokens_per_micro_batch=24,
                            parallel=ParallelConfig(world_size=2, tp=tp, ep=ep, sequence_parallel=sp))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        out[(tp, ep, sp)] = engine.compute_logprobs(recorded_batch())["logprobs"]
    return out


def test_replay_under_sequence_parallelism_and_expert_parallelism(moe_dir):
    """TP=2 with sequence parallelism (each rank's routers see its slice of the positions) and EP=2 (the routers
    choose before the tokens are dispatched: every rank takes its own tokens' full top-k)."""
    reference = forced_hf_logprobs(moe_dir, recorded_batch())
    for layout, logprobs in run_distributed(_layouts_rank, 2, moe_dir, timeout=300).items():
        torch.testing.assert_close(logprobs, reference, rtol=0, atol=1e-5, msg=str(layout))


def _replayed_logprobs(rank, model_dir):
    from megarl.engine import MegatronEngine

    actor = ActorConfig(router_replay="rollout", micro_batch_size=2, max_tokens_per_micro_batch=24)
    return MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10).compute_logprobs(recorded_batch())


def test_qwen3_next_replays_the_recorded_experts(next_dir):
    from tests.engine.hf_models import hf_logprobs_entropy

    reference = forced_hf_logprobs(next_dir, recorded_batch())
    own, _ = hf_logprobs_entropy(next_dir, recorded_batch())
    assert (own - reference).abs().max() > 1e-2  # the record is not the model's own routing
    logprobs = run_distributed(_replayed_logprobs, 1, next_dir, timeout=300)["logprobs"]
    # relative too: the forced routes give log-probs down to -14, whose float32 rounding in transformers' gated delta
    # nets alone is ~1e-5 (its float64 forward differs by that much)
    torch.testing.assert_close(logprobs, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["moe_dir", "next_dir"])
def test_hf_engine_records_transformers_routing(model, request):
    moe_dir = request.getfixturevalue(model)
    from transformers import AutoModelForCausalLM

    from megarl.rollout.base import SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(moe_dir, record_routing=True)
    prompts = [[5, 9, 17, 3], [40, 2], [7, 7, 7, 8, 1, 60]]
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=4))
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for g in generations:
        sequence = prompts[g.prompt_index] + g.token_ids
        assert g.routed_experts.shape == (len(sequence) - 1, LAYERS, TOPK)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sequence[:-1]]), output_router_logits=True).router_logits
        for layer, layer_logits in enumerate(logits):
            own = layer_logits.reshape(len(sequence) - 1, EXPERTS).topk(TOPK, dim=-1).indices.sort(-1).values
            assert torch.equal(g.routed_experts[:, layer].long().sort(-1).values, own)


def test_hf_engine_refuses_gates_without_indices(tmp_path):
    """DeepSeek-V3's gate returns logits only (its MoE block chooses by groups and a bias): not recorded by guess."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.hf import HFRolloutEngine
    from tests.models.hf_families import deepseek_v3_config

    config = deepseek_v3_config(layers=2, first_k_dense_replace=1)
    config.eos_token_id = 100
    engine = HFRolloutEngine(save_random(config, tmp_path / "deepseek"), record_routing=True)
    with pytest.raises(ValueError, match="cannot record DeepseekV3TopkRouter's routing"):
        engine.generate([[5, 9]], SamplingParams(max_new_tokens=2))


def test_dense_model_refused_and_concat_pads_the_record():
    dense = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
             "intermediate_size": 48}
    with pytest.raises(ConfigError, match=r"actor\.router_replay=rollout .*dense model"):
        check_model_layout(ActorConfig(router_replay="rollout"), "actor", dense, "dense/config.json")
    check_model_layout(ActorConfig(), "actor", dense, "dense/config.json")
    short = Batch({"routed_experts": torch.zeros(1, 2, LAYERS, TOPK, dtype=torch.int16)})
    long = Batch({"routed_experts": torch.ones(2, 3, LAYERS, TOPK, dtype=torch.int16)})
    joined = Batch.concat([short, long], pad={"routed_experts": -1})["routed_experts"]
    assert joined.shape == (3, 3, LAYERS, TOPK) and (joined[0, 2] == -1).all() and (joined[1:] == 1).all()


def test_sglang_record_decoded():
    """SGLang's meta_info['routed_experts'] (base64 int32 [prompt + response - 1, layers, topk]) into a Generation;
    a row with no new tokens keeps its earlier record (None)."""
    import base64

    from megarl.rollout.sglang import _to_generation

    record = torch.randint(0, EXPERTS, (4 + 3 - 1, LAYERS, TOPK), dtype=torch.int32)
    meta = {"routed_experts": base64.b64encode(record.numpy().tobytes()).decode(), "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.5, t, None] for t in (11, 12, 13)]}
    g = _to_generation(0, {"meta_info": meta}, (LAYERS, TOPK), fed=4)
    assert g.token_ids == [11, 12, 13] and torch.equal(g.routed_experts, record.to(torch.int16))
    with pytest.raises(Exception, match="routed_experts for 6 tokens, the row fed 7"):
        _to_generation(0, {"meta_info": meta}, (LAYERS, TOPK), fed=5)
    empty = dict(meta, output_token_logprobs=[])
    assert _to_generation(0, {"meta_info": empty}, (LAYERS, TOPK), fed=4).routed_experts is None

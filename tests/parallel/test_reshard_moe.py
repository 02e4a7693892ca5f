"""Resharding mixture-of-experts policies (a tiny Qwen3-MoE and a tiny DeepSeek-V3) from expert-parallel training
layouts into generation TP 1/2/4, with and without generation EP (SGLang's --ep-size), both deliveries, on 4 gloo
ranks against the HF checkpoint.

One launch changes megatron's layout in place (TP=2 x EP=2, PP=2 x EP=2, EP=4, TP=2 x EP=2 with ETP=1, EP=2 x
ETP=2); per layout every rank checks, for every generation layout and delivery:
- each tensor it receives is bitwise the checkpoint's (whole: full; its rows: sharded), and it receives exactly
  the tensors it holds in generation: with generation EP only the routed experts of its EP slice, as SGLang
  0.5.17 places them (FusedMoE: moe_tp = TP / EP fastest, contiguous blocks of num_experts / EP experts);
- the bytes it received and sent on the wire (batch_isend_irecv, wrapped) equal the planner's transfer_bytes, and
  what it received equals what it needs minus the rows megatron's own parameters give it (written out here from
  SGLang's placement and megatron's expert ownership, not from the plan): nothing moves to a rank that does not
  need it;
- every expert row block moves from a rank whose megatron parameters hold that expert (EP owner, ETP block) to
  a rank that holds it in generation.
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import GenLayout, TrainLayout
from megarl.reshard.transfers import plan_tensor, transfer_bytes
from tests.dist_utils import run_distributed
from tests.models.hf_families import deepseek_v3_config, qwen3_moe_config, save_random
from tests.parallel.test_reshard import _CountP2P

BUCKET = 64 << 10  # several buckets per sync (the bucket memory bound itself: tests/parallel/test_reshard.py)
GENS = [GenLayout(1), GenLayout(2), GenLayout(2, 2), GenLayout(4), GenLayout(4, 2), GenLayout(4, 4)]


def _sglang_rows(spec, gen: GenLayout, rank: int):
    """Rows SGLang 0.5.17's TP rank `rank % gen.tp` holds (None: none): FusedMoE's moe_ep_rank = tp_rank // moe_tp
    holds experts [ep_rank * E / EP, (ep_rank + 1) * E / EP), each cut into moe_tp = TP / EP row blocks."""
    t = rank % gen.tp
    if spec.expert is None:
        return spec.rows(gen.tp, t)
    moe_tp = gen.tp // gen.ep
    local = spec.experts // gen.ep
    if not (t // moe_tp) * local <= spec.expert < (t // moe_tp + 1) * local:
        return None
    return spec.rows(moe_tp, t % moe_tp)


def _relayout(tp, pp, ep, etp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(1)


def _check_rank(rank, cases, layouts):
    import torch.distributed as dist

    from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
    from megarl.engine import MegatronEngine
    from megarl.reshard.resharder import engine_resharder

    out = []
    for (model, model_dir), (tp, pp, ep, etp) in ((c, l) for c in cases for l in layouts):
        checkpoint = load_file(f"{model_dir}/model.safetensors")
        _relayout(tp, pp, ep, etp)
        parallel = ParallelConfig(world_size=4, tp=tp, pp=pp, ep=ep, etp=etp or 0, sequence_parallel=tp > 1)
        engine = MegatronEngine(model_dir, ActorConfig(parallel=parallel), AlgorithmConfig(), "cpu", 1, 10)
        resharder = engine_resharder(engine, rank)
        train, specs = resharder.train, resharder.specs
        assert (train.tp, train.pp, train.ep, train.etp) == (tp, pp, ep, etp or tp)
        # what megatron's parameters give each rank: HF name -> rows (the resharder's HeldRows come from them)
        held = [None] * 4
        dist.all_gather_object(held, {n: (h.lo, h.hi) for n, h in resharder.local.items()})
        by_name = {s.name: s for s in specs}
        experts_held = {n for n in held[rank] if by_name[n].expert is not None}
        stage_experts = [s for s in specs if s.expert is not None and train.stage(s) == train.coords(rank)[2]]
        assert len(experts_held) == len(stage_experts) // ep  # this EP rank's share of its stage's experts
        for name in held[rank]:  # and those are exactly what the layout says the rank holds
            assert train.held(by_name[name], rank) == held[rank][name], name
        for gen in GENS:
            for delivery in ("full", "sharded"):
                where = (model, tp, pp, ep, etp, gen, delivery)
                want_recv, want_sent = transfer_bytes(specs, train, gen, delivery, itemsize=4)
                need_bytes = 0
                for spec in specs:
                    rows = _sglang_rows(spec, gen, rank)
                    if rows is None:
                        continue
                    lo, hi = rows if delivery == "sharded" else (0, spec.length)
                    own = held[rank].get(spec.name)
                    mine = max(0, min(hi, own[1]) - max(lo, own[0])) if own and spec.dim is not None else \
                        (hi - lo if own else 0)
                    need_bytes += (hi - lo - mine) * spec.row_numel * 4
                    if spec.expert is not None:
                        for p in plan_tensor(spec, train, gen, delivery):
                            src = held[p.src].get(spec.name)
                            assert src and src[0] <= p.lo and p.hi <= src[1], (where, spec.name, p)
                            assert _sglang_rows(spec, gen, p.dst) is not None, (where, spec.name, p)
                received = set()
                with _CountP2P(dist) as count:
                    for bucket in resharder.buckets(gen, delivery, BUCKET, torch.float32):
                        for name, tensor in bucket:
                            spec, expected = by_name[name], checkpoint[name]
                            if delivery == "sharded" and spec.dim is not None:
                                lo, hi = _sglang_rows(spec, gen, rank)
                                expected = expected.narrow(spec.dim, lo, hi - lo)
                            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (where, name)
                            received.add(name)
                assert received == {s.name for s in specs if _sglang_rows(s, gen, rank) is not None}, where
                assert (count.recv, count.sent) == (want_recv[rank], want_sent[rank]), where
                assert count.recv == need_bytes, (where, count.recv, need_bytes)
                out.append((where, count.recv, count.sent))
    gathered = [None] * 4
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Qwen3-MoE (4 experts in both layers) and DeepSeek-V3 (MLA; a dense first layer, then 8 routed experts and a
    shared one)."""
    root = tmp_path_factory.mktemp("reshard_moe")
    return [("qwen3_moe", save_random(qwen3_moe_config(tied=False, norm_topk_prob=True, num_experts=4),
                                      root / "qwen3_moe", seed=3)),
            ("deepseek_v3", save_random(deepseek_v3_config(layers=2, first_k_dense_replace=1), root / "deepseek_v3",
                                        seed=4))]


# (tp, pp, ep, etp) on 4 ranks: expert DP = 4 / (etp x ep x pp)
LAYOUTS = ((2, 1, 2, None), (1, 2, 2, None), (1, 1, 4, None), (2, 1, 2, 1), (1, 1, 2, 2))


def test_moe_reshard_from_ep_layouts_bitwise_bytes_and_placement(cases):
    stats = run_distributed(_check_rank, 4, cases, LAYOUTS, timeout=300)
    # whole tensors (full) of only its own experts: generation EP moves less than every rank taking every expert;
    # sharded moves each expert's rows once either way (whole experts to one rank, or a quarter to each of four)
    total = {}
    for rows in stats:
        for where, recv, _ in rows:
            total[where] = total.get(where, 0) + recv
    for layout in ((model, *layout) for model, _ in cases for layout in LAYOUTS):
        assert total[(*layout, GenLayout(4, 4), "full")] < total[(*layout, GenLayout(4), "full")]
        assert total[(*layout, GenLayout(4, 4), "sharded")] <= total[(*layout, GenLayout(4), "sharded")]


@pytest.mark.parametrize("tp,pp,ep,etp,world", [(2, 1, 2, 1, 4), (1, 1, 2, 2, 4), (2, 2, 2, 1, 8), (1, 2, 4, 2, 16),
                                                (2, 1, 4, 2, 8)])
def test_expert_ranks_follow_megatrons_rank_generator(tp, pp, ep, etp, world):
    """TrainLayout's expert coordinates are megatron-core's (RankGenerator, order tp-ep-dp-pp with tp = ETP), and
    the plan moves ETP blocks of an expert only from the ranks megatron gives that expert's EP rank."""
    from megatron.core.parallel_state import RankGenerator

    train = TrainLayout(tp, pp, world // (tp * pp), 4, ep=ep, etp=etp)
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for name, index in (("tp", 0), ("ep", 1), ("dp", 2), ("pp", 3)):
        for group in experts.get_ranks(name):
            assert [train.expert_coords(r)[index] for r in group] == list(range(len(group))), (name, group)
    for name, index in (("tp", 0), ("dp", 1), ("pp", 2)):
        for group in dense.get_ranks(name):
            assert [train.coords(r)[index] for r in group] == list(range(len(group))), (name, group)
    specs = [s for s in hf_inventory(dict(qwen3_moe_config(False, True, num_experts=8).to_dict(), num_hidden_layers=4))
             if s.expert is not None]
    ep_groups = experts.get_ranks("ep")
    for spec in specs:
        owners = {g[train.expert_owner(spec)] for g in ep_groups}  # every (etp, dp, pp) replica's owning rank
        for gen in (GenLayout(min(world, 4)), GenLayout(min(world, 4), 2)):
            for delivery in ("full", "sharded"):
                for p in plan_tensor(spec, train, gen, delivery):
                    assert p.src in owners and train.held(spec, p.src) is not None, (spec.name, p)
                    lo, hi = train.held(spec, p.src)
                    assert lo <= p.lo and p.hi <= hi and gen.rows(spec, p.dst) is not None, (spec.name, p)

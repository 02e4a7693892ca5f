"""Resharding from training layouts (TP, PP, DP) to generation TP on 4 gloo ranks, against the HF checkpoint.

One launch per training layout; inside it every generation TP in {1, 2, 4} and both deliveries. Each
rank checks that every tensor it receives is bitwise the checkpoint's tensor (full) or its TP rows
(sharded), that the bytes it received and sent (counted by wrapping torch.distributed's
batch_isend_irecv) equal the planner's, and that the resharder's own live allocations during the sync (the new
storages its torch ops return, counted until freed) stay within one bucket. Not the process heap: that also
holds what gloo buffers for messages that arrive early, which made the bound flaky.
"""

import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import TrainLayout, generation_ranks
from megarl.reshard.transfers import transfer_bytes
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_distinct_qwen2_dir

BUCKET = 256 << 10
GEN_TPS = (1, 2, 4)


class _PeakLive(TorchDispatchMode):
    """Peak bytes of the storages allocated by the ops run under it, summed while they live.

    A new allocation is an op output whose storage is none of its inputs' (views, in-place and out= ops return
    theirs), so tensors made before (the model's weights) never count. torch keeps one Python object per storage,
    alive exactly as long as the storage (C++ references, gloo's, included): a weak key per storage tracks its
    freeing."""

    def __init__(self):
        super().__init__()
        self.live = weakref.WeakKeyDictionary()  # storage -> nbytes
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(storage := t.untyped_storage()) not in inputs \
                    and storage not in self.live:
                self.live[storage] = storage.nbytes()
        self.peak = max(self.peak, sum(self.live.values()))
        return out


class _CountP2P:
    """Wraps torch.distributed.batch_isend_irecv (the only collective the resharder may use)."""

    def __init__(self, monkeypatch_target):
        self.dist, self.recv, self.sent = monkeypatch_target, 0, 0
        self.original = monkeypatch_target.batch_isend_irecv

    def __enter__(self):
        def counted(ops):
            for op in ops:
                nbytes = op.tensor.numel() * op.tensor.element_size()
                if op.op is self.dist.irecv:
                    self.recv += nbytes
                else:
                    self.sent += nbytes
            return self.original(ops)
        self.dist.batch_isend_irecv = counted
        return self

    def __exit__(self, *exc):
        self.dist.batch_isend_irecv = self.original


def _check_rank(rank, model_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.engine import MegatronEngine
    from megarl.reshard.resharder import Resharder, held_rows
    from megarl.reshard.layout import new_generation_group

    engine = MegatronEngine(model_dir, ActorConfig(), AlgorithmConfig(), "cpu", 1, 10)
    train = TrainLayout(mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                        mpu.get_data_parallel_world_size(), engine.hf_config["num_hidden_layers"])
    assert train.coords(rank) == (mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank(),
                                  mpu.get_pipeline_model_parallel_rank())
    if train.tp in GEN_TPS:  # a generation group of the training TP size is exactly the training TP group
        ranks = generation_ranks(train, train.tp)
        assert dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()) in ranks
    group = new_generation_group(train, 2)  # built in place: the same processes, a new communicator
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    assert total.item() == 2 * (rank // 2) + 2 * (rank // 2) + 1
    specs = hf_inventory(engine.hf_config)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    assert sorted(s.name for s in specs) == sorted(checkpoint)
    resharder = Resharder(specs, train, held_rows(engine.gpt, engine.weight_maps, specs, train, rank), rank)
    stats = []
    for gen_tp in GEN_TPS:
        for delivery in ("full", "sharded"):
            want_recv, want_sent = transfer_bytes(specs, train, gen_tp, delivery, itemsize=4)
            received, mode = set(), _PeakLive()
            with _CountP2P(dist) as count:
                buckets = resharder.buckets(gen_tp, delivery, BUCKET, torch.float32)
                while True:
                    with mode:
                        bucket = next(buckets, None)
                    if bucket is None:
                        break
                    for name, tensor in bucket:
                        spec = next(s for s in specs if s.name == name)
                        expected = checkpoint[name]
                        if delivery == "sharded" and spec.dim is not None:
                            lo, hi = spec.rows(gen_tp, rank % gen_tp)
                            expected = expected.narrow(spec.dim, lo, hi - lo)
                        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (name, gen_tp, delivery)
                        received.add(name)
                    del bucket
            assert received == set(checkpoint), (gen_tp, delivery)
            assert (count.recv, count.sent) == (want_recv[rank], want_sent[rank]), (gen_tp, delivery, count.recv, count.sent, want_recv[rank], want_sent[rank])
            stats.append((gen_tp, delivery, count.recv, count.sent, mode.peak))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    return gathered


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_distinct_qwen2_dir(tmp_path_factory.mktemp("reshard") / "qwen2", vocab_size=101, layers=24, heads=8, kv_heads=4)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_reshard_bitwise_bytes_and_memory(model_dir, tp, pp):
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoint.values())
    largest = max(t.numel() * t.element_size() for t in checkpoint.values())
    assert model_bytes >= 10 * BUCKET and largest < BUCKET
    stats = run_distributed(_check_rank, 4, model_dir, tp=tp, pp=pp)
    for rank, rows in enumerate(stats):
        for gen_tp, delivery, recv, sent, peak in rows:
            print(f"tp={tp} pp={pp} rank={rank} gen_tp={gen_tp} {delivery}: recv {recv} sent {sent} peak {peak}")
            assert peak <= max(BUCKET, largest), (rank, gen_tp, delivery, peak)
    # sharded delivery never moves more than full, and strictly less when generation TP > 1
    for rows in stats:
        by = {(g, d): r for g, d, r, _, _ in rows}
        for gen_tp in GEN_TPS:
            assert by[(gen_tp, "sharded")] <= by[(gen_tp, "full")]
    assert sum(dict(((g, d), r) for g, d, r, _, _ in rows)[(4, "sharded")] for rows in stats) < \
        sum(dict(((g, d), r) for g, d, r, _, _ in rows)[(4, "full")] for rows in stats)


def test_held_rows_keep_the_row_order_of_a_permuted_block():
    """Rows permuted inside a block whose ends look consecutive (Qwen3-Next's in_proj_qkvz in megatron's in_proj)
    come back in row order; consecutive ones as a view of the shard."""
    from megarl.reshard.resharder import HeldRows

    shard = torch.arange(12.0).reshape(6, 2)
    permuted = HeldRows(shard, 0, torch.tensor([0, 2, 1, 3]), 0, 4)  # row 1 sits at position 2, row 2 at 1
    assert torch.equal(permuted.take(0, 4), shard[[0, 2, 1, 3]])
    consecutive = HeldRows(shard, 0, torch.tensor([2, 3, 4]), 5, 8)
    taken = consecutive.take(5, 8)
    assert torch.equal(taken, shard[2:5]) and taken.data_ptr() == shard[2:5].data_ptr()

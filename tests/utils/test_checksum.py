import numpy as np
import pytest
import torch

from megarl.utils import checksum
from megarl.utils.checksum import ChecksumTable, flip_bit, module_checksums, weighted_sums


def test_sums_do_not_depend_on_chunking_or_layout(monkeypatch):
    g = torch.Generator().manual_seed(0)
    m = torch.randn(70, 30, generator=g).to(torch.bfloat16)
    whole = weighted_sums(m)
    monkeypatch.setattr(checksum, "_CHUNK", 7)  # chunks of one row (fewer than a row's elements)
    assert torch.equal(weighted_sums(m), whole)
    assert torch.equal(weighted_sums(m.view(-1)), whole)
    assert torch.equal(weighted_sums(m.t().contiguous().t()), whole)  # column-major storage, same values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_pieces_sum_to_the_whole_at_their_positions(dtype):
    """What a sender relies on to checksum SGLang's fused, sharded parameters without building them."""
    g = torch.Generator().manual_seed(1)
    q, k, v = ((torch.randn(n, 12, generator=g) * 40).to(dtype) for n in (8, 4, 4))
    fused = torch.cat([q, k, v])
    assert torch.equal(weighted_sums(fused),
                       weighted_sums(q) + weighted_sums(k, q.numel()) + weighted_sums(v, q.numel() + k.numel()))
    o = (torch.randn(6, 10, generator=g) * 40).to(dtype)  # a row-parallel weight: column blocks
    assert torch.equal(weighted_sums(o), weighted_sums(o[:, :4], 0, 10) + weighted_sums(o[:, 4:], 4, 10))
    assert torch.equal(weighted_sums(o[:, 4:]), weighted_sums(o[:, 4:].contiguous()))  # a shard, as held alone
    padded = torch.cat([q, torch.zeros(5, 12, dtype=dtype)])  # vocabulary padding: zero rows add nothing
    assert torch.equal(weighted_sums(padded), weighted_sums(q))


def test_a_flipped_bit_anywhere_changes_both_sums():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(9, 13, generator=g).to(torch.bfloat16)
    for i in (0, 57, t.numel() - 1):
        c = t.clone()
        c.view(-1)[i:i + 1].view(torch.int16).bitwise_xor_(1 << (i % 16))
        a, b = weighted_sums(t), weighted_sums(c)
        assert (a != b).all(), i
    assert not torch.equal(weighted_sums(torch.tensor([0.0])), weighted_sums(torch.tensor([-0.0])))


def test_module_checksums_cover_parameters_and_persistent_buffers_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("cache", torch.ones(3), persistent=False)  # derived (as a rotary cache): left out
    held = module_checksums(model)
    assert sorted(held) == ["0.bias", "0.weight", "1.bias", "1.num_batches_tracked", "1.running_mean",
                            "1.running_var", "1.weight"]
    assert held["0.weight"][:2] == ["torch.float32", [4, 3]] and held["1.running_mean"][-1] is True
    flip_bit(model[0].weight)
    after = module_checksums(model)
    assert after["0.weight"] != held["0.weight"] and after["0.bias"] == held["0.bias"]


def test_a_pack_copy_is_fused_only_where_the_pieces_tile_its_source_at_its_alignment():
    """What the GPU kernel is told to copy while it sums (ChecksumTable.flush(copies)): a copy whose source the
    queued pieces tile exactly, a repeated piece counted once, source and destination 16-byte congruent."""
    src = torch.arange(64 * 10, dtype=torch.float32).view(64, 10)
    out = torch.empty(2 * src.numel() + 8, dtype=torch.float32)
    dst, shifted = out[:src.numel()].view(64, 10), out[src.numel() + 1:2 * src.numel() + 1].view(64, 10)

    def plan(pieces, destination):
        runs = [(p.data_ptr(), p.shape[0], p.shape[1], p.stride(0) * 4, 0, 0, 10, p) if not p.is_contiguous()
                else (p.data_ptr(), 1, p.numel(), 0, 0, 0, 0, p) for p in pieces]
        address, length, _, _ = checksum._segments(runs)
        destinations, copy, fused = checksum._fuse(address, length, 4, [(7, src, destination)])
        return copy, fused, destinations

    copy, fused, destinations = plan([src[32:], src[:32]], dst)  # row blocks of two ranks
    assert fused == {7} and copy.tolist() == [True, True]
    assert destinations.tolist() == [dst.data_ptr() + 32 * 40, dst.data_ptr()]
    assert plan([src[:32], src[32:], src], dst)[1] == set()  # overlapping pieces that are not the same: torch copies
    copy, fused, destinations = plan([src[:, :4], src[:, 4:], src[:, :4]], dst)  # column blocks: a run per row
    assert fused == {7} and copy.sum() == 128 and destinations[copy].min() == dst.data_ptr()
    assert plan([src, src], dst)[1] == {7}  # replicated on two ranks: one copy
    assert plan([src[:63]], dst)[1] == set()  # a row short
    assert plan([src], shifted)[1] == set()  # destination 4 bytes off the source's alignment


def test_staging_reuses_its_buffers_and_keeps_both_tables_aligned():
    """A launch's segment table (int64 meta, int32 programs) goes to the device through buffers kept per device:
    after the first launch of a size none is allocated (a pinned allocation can stall on a busy GPU), both views
    start 16-byte aligned (Triton specialises on it), and each launch gets its own values."""
    staging = checksum._Staging(torch.device("cpu"))
    for rows, programs in ((3, 5), (7, 1), (3, 9)):  # odd meta sizes: the programs must still start aligned
        meta = np.arange(8 * rows, dtype=np.int64).reshape(8, rows) * 1000 + rows
        segment = np.arange(programs, dtype=np.int32) + rows
        with staging.stage(meta, segment) as (on_device, per_program):
            assert on_device.tolist() == meta.reshape(-1).tolist() and per_program.tolist() == segment.tolist()
            assert on_device.data_ptr() % 16 == 0 and per_program.data_ptr() % 16 == 0
            assert per_program.dtype == torch.int32
    assert staging.allocations == 1
    with staging.stage(np.zeros((8, 2), np.int64), np.ones(1 << 14, np.int32)) as (_, per_program):  # grows
        assert per_program.sum().item() == 1 << 14
    with staging.stage(np.ones((8, 2), np.int64), np.zeros(3, np.int32)) as (on_device, _):
        assert on_device.sum().item() == 16
    assert staging.allocations == 2


def test_a_reset_table_sums_the_next_sync_alone():
    """A sender keeps one table across syncs: reset zeroes it, and fetch (the read-back queued before the sync's
    end) leaves values equal to a fresh table's."""
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    kept, alone = ChecksumTable(2, "cpu"), ChecksumTable(1, "cpu")
    kept.add(0, first)
    alone.add(0, first)
    kept.fetch()
    assert kept.values()[0] == alone.values()[0] != [0, 0]
    kept.reset()
    assert kept.values() == [[0, 0], [0, 0]]
    kept.add(1, second[:3], offset=0)
    kept.add(1, second[3:], offset=15)
    kept.fetch()
    fresh = ChecksumTable(2, "cpu")
    fresh.add(1, second)
    assert kept.values() == fresh.values() and fresh.values()[1] != [0, 0]

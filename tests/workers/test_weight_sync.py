import pytest
import torch

from megarl.workers.weight_sync import WeightSyncError, digests_of, push_buckets, tensor_digest, verify


def test_digest_is_bitwise():
    a = torch.randn(4, 5)
    b = a.clone()
    assert tensor_digest(a) == tensor_digest(b)
    b[2, 3] = torch.nextafter(b[2, 3], torch.tensor(1e9))  # one ulp
    assert tensor_digest(a) != tensor_digest(b)
    assert tensor_digest(a) != tensor_digest(a.view(5, 4))


def test_push_then_verify_against_the_receivers_own_copy():
    weights = {"w1": torch.randn(3, 3), "w2": torch.randn(7)}
    held = {}
    report = push_buckets([[("w1", weights["w1"])], [("w2", weights["w2"])]],
                          lambda bucket: held.update({n: t.clone() for n, t in bucket}))
    assert report["bytes"] == (9 + 7) * 4
    dtypes = {n: d for n, (d, _) in report["sent"].items()}
    verify(report["sent"], digests_of(held, dtypes))

    held["w2"][4] += 1e-3  # the receiver holds something else than what was sent
    with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) differ \['w2'\]"):
        verify(report["sent"], digests_of(held, dtypes))
    del held["w1"]
    with pytest.raises(WeightSyncError, match=r"1 missing \['w1'\]"):
        verify(report["sent"], digests_of(held, dtypes))

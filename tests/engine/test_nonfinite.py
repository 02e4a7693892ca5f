"""A NaN loss or gradient never reaches the weights: the update stops with an error naming the step, the rank and
the micro-batch, or (skip_nonfinite_updates) is skipped, counted, with weights and optimizer state untouched."""

import math

import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch


def _share(rank: int, nan_row: int | None):
    """This DP rank's 4 rows; a NaN advantage on one real token of `nan_row` (rank 1 only)."""
    batch = padded_batch(rows=8).chunk(2)[rank]
    g = torch.Generator().manual_seed(3)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=g) * batch["loss_mask"]
    if rank == 1 and nan_row is not None:
        batch["advantages"][nan_row, 3] = float("nan")
    return batch


def _tensors(tree) -> list:
    if torch.is_tensor(tree):
        return [tree.clone()]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]


def _state(engine):
    """Weights, and every tensor of the optimizer's state (Adam's moments and steps; bf16: the fp32 master copies)."""
    return [p.detach().clone() for p in engine._parameters()], _tensors(engine.optimizer.state_dict())


def _equal(a, b) -> bool:
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b))


def _errors_rank(rank, model_dir):
    """DP=2, packed into rows of 16 tokens: rank 1's rows of 4, 9, 12 and 3 tokens go [12, 4], [9, 3], so its row 2
    is in its micro-batch 1 of 2, while rank 0's rows of 12, 7, 1 and 10 tokens take 3 micro-batches."""
    from megarl.engine import MegatronEngine

    engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=2, max_tokens_per_micro_batch=16),
                            AlgorithmConfig(), "cpu", 1, 10)
    engine.train(_share(rank, None))  # a clean update first: the optimizer has state to keep
    errors = {}
    with pytest.raises(FloatingPointError) as loss_error:
        engine.train(_share(rank, nan_row=2))
    errors["loss"] = str(loss_error.value)
    # A finite loss whose gradient is NaN (one weight's gradient poisoned on rank 0).
    hook = engine._parameters()[0].register_hook(lambda grad: grad * float("nan") if rank == 0 else grad)
    with pytest.raises(FloatingPointError) as grad_error:
        engine.train(_share(rank, None))
    hook.remove()
    errors["grad"] = str(grad_error.value)

    engine.skip_nonfinite_updates = True
    before = _state(engine)
    skipped = engine.train(_share(rank, nan_row=2))
    after_skip = _state(engine)
    applied = engine.train(_share(rank, None))
    kept = {"fp32": _equal(before, after_skip)}
    moved = {"fp32": not _equal(before, _state(engine))}
    # bf16 (as on GPU): megatron's mixed-precision optimizer, its fp32 master weights untouched too
    engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=2, precision="bf16"), AlgorithmConfig(), "cpu", 1,
                            10, skip_nonfinite_updates=True)
    engine.train(_share(rank, None))
    before = _state(engine)
    kept["bf16"] = engine.train(_share(rank, nan_row=2))["skipped_updates"] == 1 and _equal(before, _state(engine))
    engine.train(_share(rank, None))
    moved["bf16"] = not _equal(before, _state(engine))
    return errors, skipped, applied, kept, moved


def test_nonfinite_loss_or_grad_stops_the_update_naming_step_rank_micro_batch_or_is_skipped(tmp_path):
    errors, skipped, applied, kept, moved = run_distributed(
        _errors_rank, 2, make_qwen2_dir(tmp_path / "m", tied=False))
    # Every rank raises the same agreed error: rank 0's names rank 1's micro-batch.
    assert "non-finite loss" in errors["loss"]
    assert "RL step 2" in errors["loss"] and "rank 1 (micro-batch 1 of 2" in errors["loss"]
    assert "rank 0" not in errors["loss"] and "trainer.skip_nonfinite_updates" in errors["loss"]
    assert "non-finite gradient norm" in errors["grad"] and "RL step 3" in errors["grad"]
    # Skipped: counted, no loss metrics from the poisoned update, weights and Adam state equal bit for bit.
    assert skipped["skipped_updates"] == 1 and "loss" not in skipped
    assert kept == {"fp32": True, "bf16": True}
    # The next clean update applies (its gradient buffers were cleared of the NaNs).
    assert applied["skipped_updates"] == 0 and math.isfinite(applied["loss"]) and math.isfinite(applied["grad_norm"])
    assert moved == {"fp32": True, "bf16": True}

"""A save killed from inside megatron's checkpoint writer leaves the previous checkpoint complete.

A one-rank training process (run as `python -m tests.engine.test_checkpoint_crash`) saves
checkpoint 1, trains on, and starts checkpoint 2 with a hook in megatron's file writer that, once a
tensor is on disk, SIGKILLs the training process. Afterwards `resume=auto` picks checkpoint 1, and a
2-rank TP=2 engine loads it with the exact weights the dead process had saved.
"""

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from megarl.engine.checkpoint_dir import Checkpoints
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch
from tests.engine.test_checkpoint import ALGO, actor_config, rl_step, save

REPO = Path(__file__).resolve().parents[2]


def _weights(engine) -> dict:
    return {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}


def _kill_inside_the_writer() -> None:
    """megatron writes each tensor with filesystem_async._write_item, in writer processes forked from
    this one: after the first tensor is written, kill the training process and the writer."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    write_item, trainer = filesystem_async._write_item, os.getpid()

    @functools.wraps(write_item)  # megatron reads its signature
    def write_then_die(*args, **kwargs):
        write_item(*args, **kwargs)
        os.kill(trainer, signal.SIGKILL)
        os._exit(1)

    filesystem_async._write_item = write_then_die


def crash_job(root: Path, model_dir: str, weights_path: Path) -> None:
    from megarl.engine import MegatronEngine
    from megarl.parallel.state import init_parallel
    from tests.dist_utils import free_port

    torch.set_num_threads(1)
    init_parallel(0, 1, "127.0.0.1", free_port(), device="cpu", seed=1)
    engine = MegatronEngine(model_dir, actor_config(False), ALGO, "cpu", 1, total_steps=10)
    engine.train(padded_batch(rows=8, seed=50), loss="sft", lr=1e-2)
    engine.snapshot_reference()
    rl_step(engine, 1)
    save(engine, root, 1)
    torch.save(_weights(engine), weights_path)
    rl_step(engine, 2)
    _kill_inside_the_writer()
    save(engine, root, 2)
    sys.exit("the second save was not interrupted")


def _load_rank(rank, root):
    from megarl.engine import MegatronEngine

    root = Path(root)
    engine = MegatronEngine(str(root.parent / "qwen2"), actor_config(False), ALGO, "cpu", 1, total_steps=10)
    latest = Checkpoints(root).resolve("auto")
    engine.load_checkpoint(str(latest / "actor"))
    weights, version = _weights(engine), engine.version
    rl_step(engine, 2)
    save(engine, root, 2)  # the next save clears the dead one's leftovers
    return latest.name, weights, version


def test_a_save_killed_mid_write_leaves_the_last_checkpoint_usable(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    root, weights_path = tmp_path / "ckpt", tmp_path / "weights.pt"
    log = tmp_path / "job.log"  # a file, not a pipe: processes the killed one leaves behind would hold a pipe open
    with open(log, "w") as out:
        job = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.test_checkpoint_crash", str(root), model_dir, str(weights_path)],
            cwd=REPO, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        job.wait(timeout=300)
    finally:
        # what the killed process left running (megatron's spawn-context Manager) goes with its session
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert job.returncode == -signal.SIGKILL, log.read_text()[-3000:]

    # The interrupted save is only a staging directory, without megatron's final metadata.
    names = sorted(p.name for p in root.iterdir())
    assert names == [".tmp-step_00000002", "latest", "step_00000001"], names
    assert any((root / ".tmp-step_00000002" / "actor" / "state").glob("*.distcp"))
    assert not (root / ".tmp-step_00000002" / "actor" / "state" / "metadata.json").exists()
    assert (root / "latest").read_text().strip() == "step_00000001"

    loaded_from, weights, version = run_distributed(_load_rank, 2, str(root), tp=2)
    assert loaded_from == "step_00000001"
    assert version == 3  # 1 SFT step + 1 RL step of 2 epochs
    saved = torch.load(weights_path)
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[n], saved[n]) for n in saved)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]


if __name__ == "__main__":
    crash_job(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))

"""A full disk is named: a save without room for a checkpoint is refused before it writes, a write that runs out of
space (ENOSPC, or torch's short-write "unexpected pos") becomes a DiskSpaceError naming the directory, and the
previous checkpoint stays complete and intact; the run then ends with one line (stops.end), exit status 1."""

import errno
import shutil
import subprocess
from collections import namedtuple

import pytest
import torch

from megarl import stops
from megarl.config.tiny import tiny_config
from megarl.engine import checkpoint_dir
from megarl.engine.checkpoint_dir import Checkpoints, DiskSpaceError, checkpoint_bytes, checkpoint_damage

Usage = namedtuple("Usage", "total used free")
SHORT_WRITE = "[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598"


def save(checkpoints: Checkpoints, step: int, payload: int = 4096):
    with checkpoints.writing(step) as staging:
        (staging / "actor").mkdir()
        torch.save(torch.zeros(payload // 4), staging / "actor" / "weights.pt")
        return checkpoints.commit(staging, step, {"step": step})


def free_space(monkeypatch, free: int):
    monkeypatch.setattr(checkpoint_dir.shutil, "disk_usage", lambda path: Usage(1 << 40, (1 << 40) - free, free))


def test_a_save_without_room_for_it_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    checkpoints = Checkpoints(tmp_path / "ckpt", first_bytes=5 << 30)
    first = save(checkpoints, 1)
    size = checkpoint_bytes(first)
    assert size == sum(p.stat().st_size for p in first.rglob("*") if p.is_file()) > 4096
    free_space(monkeypatch, size - 1)
    with pytest.raises(DiskSpaceError) as refused:
        save(checkpoints, 2)
    assert str(refused.value).startswith(
        f"no room for checkpoint step_00000002 in {tmp_path / 'ckpt'}: {(size - 1) / 1024:.2f} KiB free, and it needs "
        f"about {size / 1024:.2f} KiB (what step_00000001 takes). Free space there, or set trainer.checkpoint_dir to a "
        "disk with room")
    assert f"the newest complete checkpoint, {first}, is intact" in str(refused.value)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000001"]
    free_space(monkeypatch, size)
    assert save(checkpoints, 2).name == "step_00000002"
    # before the first checkpoint: the trainer's estimate of its parameters and optimizer state
    free_space(monkeypatch, 4 << 30)
    with pytest.raises(DiskSpaceError, match=r"4.00 GiB free, and it needs about 5.00 GiB \(the parameters and "
                                             r"optimizer state\).* no checkpoint was completed"):
        save(Checkpoints(tmp_path / "other", first_bytes=5 << 30), 1)


@pytest.mark.parametrize("error, free, named", [
    (OSError(errno.ENOSPC, "No space left on device"), 10 << 30, True),
    (RuntimeError(f"actor rank 0 failed in save_checkpoint: ray::TrainWorker.save_checkpoint()\n  File ...\n"
                  f"RuntimeError: {SHORT_WRITE}\n...\nCheckpointException ranks:dict_keys([])"), 1 << 20, True),
    # a worker's error, on a disk found full (as a 2 MiB tmpfs gave it)
    (RuntimeError(SHORT_WRITE), 10 << 30, False),  # not a full disk: passes as it is
])
def test_a_write_that_runs_out_of_space_is_named_and_the_previous_checkpoint_kept(tmp_path, monkeypatch, error, free,
                                                                                  named):
    checkpoints = Checkpoints(tmp_path)
    first = save(checkpoints, 1)
    free_space(monkeypatch, free)
    with pytest.raises(DiskSpaceError if named else RuntimeError) as failed:
        with checkpoints.writing(2) as staging:
            (staging / "actor").mkdir()
            raise error
    if named:
        assert str(failed.value).startswith(f"the disk of {tmp_path} filled up writing checkpoint step_00000002")
        assert f"the newest complete checkpoint, {first}, is intact" in str(failed.value)
        assert not (tmp_path / ".tmp-step_00000002").exists()  # the partial checkpoint is gone
        if SHORT_WRITE in str(error):
            assert (f"; RuntimeError: actor rank 0 failed in save_checkpoint: ray::TrainWorker.save_checkpoint() ... "
                    f"RuntimeError: {SHORT_WRITE})") in str(failed.value)
    else:
        assert failed.value is error
    assert checkpoints.latest() == first and checkpoint_damage(first, "full") == []


def test_on_a_full_tmpfs_the_real_write_error_is_named(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                                       capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (the monkeypatched tests above cover the logic)")
    try:
        checkpoints = Checkpoints(mount)
        first = save(checkpoints, 1, payload=64 << 10)
        with pytest.raises(DiskSpaceError, match=f"the disk of {mount} filled up writing checkpoint step_00000002"):
            save(checkpoints, 2, payload=4 << 20)  # 4 MiB into what is left of 1 MiB: torch's own write fails
        assert checkpoints.latest() == first and checkpoint_damage(first, "full") == []
        assert sorted(p.name for p in mount.iterdir()) == ["latest", "step_00000001"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_the_run_ends_on_it_with_one_line_and_status_1(tmp_path, capfd, monkeypatch):
    run = stops._Run(tiny_config(["trainer.save_every=5", f"trainer.output_dir={tmp_path}"]))
    run.current = 7
    monkeypatch.setattr(stops, "_run", run)

    def end_on_a_full_disk() -> str:
        with pytest.raises(SystemExit) as ended:
            try:
                raise DiskSpaceError("the disk of runs/x/checkpoints filled up writing checkpoint step_00000007")
            except DiskSpaceError:
                stops.end()
        assert ended.value.code == 1
        err = capfd.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        return err.strip()

    assert end_on_a_full_disk().startswith("megarl: stopped at step 7 of 10: the disk of runs/x/checkpoints filled up "
                                           "writing checkpoint step_00000007; start again once there is room: ")
    save(Checkpoints(tmp_path / "checkpoints"), 5)
    monkeypatch.setattr(stops, "_run", run)  # end() let go of it
    assert "; resume once there is room: " in end_on_a_full_disk()


def test_the_first_checkpoint_is_expected_to_hold_the_weights_and_adams_state():
    from megarl.data.inputs import model_inputs
    from megarl.reshard.inventory import hf_inventory
    from megarl.resume import checkpoint_estimate

    cfg = tiny_config(["algorithm.kl_coef=0"])
    model_config = model_inputs(cfg)[1]
    params = sum(spec.numel for spec in hf_inventory(model_config))
    assert params > 0
    assert checkpoint_estimate(cfg, model_config, "cpu") == params * (4 + 8)  # fp32 weights, 2 fp32 moments
    assert checkpoint_estimate(cfg, model_config, "cuda") == params * (2 + 12)  # bf16, an fp32 master and moments
    with_reference = tiny_config(["algorithm.kl_coef=0.01"])
    assert checkpoint_estimate(with_reference, model_config, "cpu") == params * (4 + 8 + 4)

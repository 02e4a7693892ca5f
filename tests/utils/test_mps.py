"""megarl.utils.mps: an SM share under CUDA MPS is refused, naming its key, where no MPS daemon runs (the variable
would be ignored silently), and becomes the process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE where one does."""

import pytest

from megarl.utils.mps import mps_share_env


def test_mps_share_needs_a_running_daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert mps_share_env(0, "async.mps_train_percent") == {}  # no limit: nothing asked of MPS
    with pytest.raises(RuntimeError, match=r"async.mps_train_percent=60 needs CUDA MPS, which is not running"):
        mps_share_env(60, "async.mps_train_percent")
    (tmp_path / "control").touch()  # the daemon's control pipe
    assert mps_share_env(60, "async.mps_train_percent") == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}

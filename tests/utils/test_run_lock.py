"""One live run per directory (megarl/utils/run_lock.py): a second run is refused naming the live owner; the lock of
an owner that died (SIGKILL: nothing released it) is taken over with a note; a run that ends releases it."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.utils.run_lock import RunLock, RunLockError

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; from megarl.utils.run_lock import RunLock; RunLock(sys.argv[1:]).acquire(); print('held', " \
       "flush=True); time.sleep(600)"


def test_a_second_run_is_refused_while_the_owner_lives_and_takes_over_once_it_is_killed(tmp_path, capsys):
    output, elsewhere = tmp_path / "run", tmp_path / "checkpoints"
    owner = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline() == "held\n"
        with pytest.raises(RunLockError) as error:
            RunLock([elsewhere, output]).acquire()
        message = str(error.value)
        assert message.startswith(f"{output} is in use by another run: pid {owner.pid} on host {socket.gethostname()}, "
                                  "started ")
        assert "give this one its own trainer.output_dir" in message and f"Lock file: {output}/run.lock" in message
        assert (elsewhere / "run.lock").read_text() == ""  # what the refused run had taken is given back
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()

    with RunLock([output]).acquire():  # the killed owner's record is still in the file
        note = capsys.readouterr().out
        assert note.startswith(
            f"note: {output}/run.lock: taken over from pid {owner.pid} on host {socket.gethostname()}, started ")
        assert note.endswith(f"which ended without releasing it (pid {owner.pid} is gone)\n")
        assert f'"pid": {os.getpid()}' in (output / "run.lock").read_text()
        with pytest.raises(RunLockError, match=f"pid {os.getpid()} on host"):  # held: this process's second run too
            RunLock([output]).acquire()
    assert (output / "run.lock").read_text() == ""  # released: the next run has no one to take over from
    with RunLock([output]).acquire():
        assert capsys.readouterr().out == ""

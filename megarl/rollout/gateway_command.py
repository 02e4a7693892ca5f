"""Command agents (agent.gateway.command): the user's agent as a program megarl runs once per agent run, for agent
harnesses that are not a Python function of megarl's process (a CLI, another language, another virtual environment).

The command (an argv list, or a string run by /bin/sh -c) starts in a process group of its own, with the environment
of the rollout worker plus
- OPENAI_BASE_URL: the gateway's endpoint (http://host:port/v1), which OpenAI's clients read by themselves (and
  OPENAI_API_BASE, the same, the name older clients and harnesses read);
- OPENAI_API_KEY: the run's key, scoped to this one trajectory;
- MEGARL_ROW_FILE: a JSON file holding the prompt row (prompt, answer, data_source, extra_info ...);
and the same JSON on its standard input, which is then closed. Its reward, if it gives one, is on the last line of its
standard output that is JSON: a number, or an object with "reward" (a number or null); no such line, or null: megarl's
reward scores the run. A command that exits non-zero is a crashed run (its stderr's end in the message); one still
running at agent.gateway.timeout_s is killed with its whole process group (its run was already counted as timed out by
gateway_agents.py). A run's processes that outlive its command are killed with the group when it ends.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from megarl.config.agent_command import command_argv

STDERR_TAIL = 2000  # characters of a failed command's stderr in its error


def reward_from_output(stdout: str) -> float | None:
    """The reward on the last line of `stdout` that is JSON: a number, or {"reward": number or null}; else None."""
    for line in reversed(stdout.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            value = value.get("reward")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"the agent command's last JSON line gives the reward {value!r}: a finite number or null")
        return float(value)
    return None


class CommandAgent:
    """An agent function (gateway_agents.py's contract) that runs `command` for each run; `close()` kills what still
    runs."""

    def __init__(self, command: list[str] | str, timeout_s: float):
        self.argv, self.timeout_s = command_argv(command), timeout_s
        self.running: set[int] = set()  # the process ids (and group ids) of the commands running
        self.lock = threading.Lock()

    def __call__(self, base_url: str, api_key: str, row: dict) -> float | None:
        payload = json.dumps(row, default=str)
        with tempfile.TemporaryDirectory(prefix="megarl-agent-") as folder:
            row_file = Path(folder) / "row.json"
            row_file.write_text(payload)
            env = os.environ | {"OPENAI_BASE_URL": base_url, "OPENAI_API_BASE": base_url, "OPENAI_API_KEY": api_key,
                                "MEGARL_ROW_FILE": str(row_file)}
            process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, env=env, start_new_session=True, text=True)
            with self.lock:
                self.running.add(process.pid)
            try:
                stdout, stderr = process.communicate(payload, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"the agent command ran past agent.gateway.timeout_s={self.timeout_s:g} s: its "
                                   "process group was killed") from None
            finally:
                with self.lock:
                    self.running.discard(process.pid)
                _kill_group(process.pid)
                with process:  # reaped, its pipes closed
                    pass
        if process.returncode != 0:
            raise RuntimeError(f"the agent command exited with code {process.returncode}; its stderr ends: "
                               f"{stderr[-STDERR_TAIL:]!r}")
        return reward_from_output(stdout)

    def close(self) -> None:
        """Kill every command still running, with its group (each one's own thread then reaps it)."""
        with self.lock:  # a command leaves `running` before it is reaped: no pid here is another process's yet
            for pid in self.running:
                _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the group has no process left
        pass

"""`python`: runs the model's code in the sandbox (megarl/sandbox/runner.py) and returns what it printed.

A limit hit (time, memory, processes, file size) or a failing script comes back as a ToolError
whose message carries the exit status and the end of stderr (the traceback), so the model can
correct itself; the process is gone by then and the conversation continues.
"""

from __future__ import annotations

from megarl.rollout.tools import TOOLS, Tool, ToolError
from megarl.sandbox.runner import Sandbox, SandboxLimits


@TOOLS.register("python")
class PythonInterpreter(Tool):
    name = "python"
    description = "Run a Python 3 script in a sandbox (no network, no files outside its directory) and " \
                  "return what it prints. Use print() to see results."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the script"}},
                  "required": ["code"]}

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 16,
                 max_output_chars: int = 2000, mode: str = "auto", python: str | None = None, slots: int = 4):
        self.max_output_chars = max_output_chars
        self.sandbox = Sandbox(SandboxLimits(wall_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes,
                                             max_output_bytes=4 * max_output_chars),
                               mode=mode, python=python, slots=slots)

    def run(self, code: str) -> str:
        if not isinstance(code, str):
            raise ToolError("'code' must be a string")
        result = self.sandbox.run(code)
        stdout = self._tail(result.stdout)
        if result.timed_out:
            raise ToolError(f"the code ran longer than {self.sandbox.limits.wall_s:g} s and was stopped\n{stdout}")
        if result.output_truncated:
            stdout += f"\n[output cut at {self.sandbox.limits.max_output_bytes} bytes]"
        if result.exit_code != 0:
            raise ToolError(f"exit status {result.exit_code}\n{stdout}{self._tail(result.stderr)}")
        return stdout + (self._tail(result.stderr) if result.stderr else "")

    def _tail(self, text: str) -> str:
        return text if len(text) <= self.max_output_chars else "..." + text[-self.max_output_chars:]

    def close(self) -> None:
        self.sandbox.close()

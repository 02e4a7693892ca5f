"""Function tests (`assert add(1, 2) == 3`) whose success a program cannot fake.

Success is what a trusted harness (harness_script.py, the sandbox's main script) reports, never the
program's exit status: a program that exits early (`os._exit(0)`, an `atexit` handler, `sys.exit` in a
`finally`), kills its parent or prints a verdict of its own scores 0. How it works:

- The program is data (program.py beside the harness); the harness forks at once. The child closes
  the private channel (runner.py) and runs the program. The parent, which never runs program code,
  makes itself non-dumpable before the fork (the child, of the same uid, can then read neither its
  memory nor its file descriptors through /proc, nor ptrace it) and only after the fork reads the
  per-run random secret and the tests from an in-memory file that exists on no file system; so the
  child never has them, in memory or anywhere it could search.
- The parent runs each test itself. The program's names that a test uses stand for objects in the
  child: calling one, or reading an attribute of one, is a request to the child, whose answer comes
  back as JSON and becomes plain data in the parent (exact builtin types: int, float, complex, str,
  bytes, bool, None, list, tuple, set, frozenset, dict) or a stand-in that can only be called again.
  Comparisons, truth tests and the rest of the test happen in the parent, so an object whose
  `__eq__` or `__bool__` always says yes never reaches them (it fails its test), and the child sees
  only the arguments of its functions, never the expected values.
- A test may expect an exception (`try: f(-1)` ... `except ValueError:`, as APPS and verl tests write it): what
  the program's code raises comes back as the builtin exception class it derives from (a program's
  `class NegativeError(ValueError)` as ValueError), made in the parent with the message; one that is no Exception
  (SystemExit) comes back as a failure no test catches by type.
- The parent writes its verdict with the secret on the private output, which no process of the
  program holds; the caller accepts only a verdict with the right secret and every test passed. If
  the child ends early (any way), its next answer is missing and the test fails.

Residual risks: builtins and modules importable in the parent (math, ...) are always the parent's
own, so a program function named like one (`def test():`) cannot be tested by that name; a test whose
expected value is itself computed by the program (`assert f(1) == f(2)`) is only as strong as the
program; arguments are copies (a test that checks an in-place change of its own list fails); a
parent-side function or lambda cannot be passed to the program; a test cannot catch a program's own exception class
by its name (`except NegativeError:`), only by a builtin one it derives from. In unsafe-rlimits mode for a non-root
caller (runner.py), the program runs as the caller's uid and could read the caller's memory, where the tests are.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from megarl.sandbox.runner import Sandbox, SandboxResult

HARNESS = (Path(__file__).parent / "harness_script.py").read_text()


@dataclass
class TestReport:
    passed: int  # tests that passed, in order, before the first failure
    total: int
    failure: str  # why not all passed; "" when they did
    run: SandboxResult

    @property
    def ok(self) -> bool:
        return not self.failure and self.passed == self.total


def new_secret() -> str:
    return secrets.token_hex(32)


def run_function_tests(sandbox: Sandbox, program: str, tests: list[str]) -> TestReport:
    """Run `program`, then each test statement (source text, usually one `assert`), in `sandbox`."""
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("tests must be a list of strings (Python statements)")
    secret = new_secret()
    result = sandbox.run(HARNESS, files={"program.py": program},
                         private_input=json.dumps({"secret": secret, "tests": tests}).encode())
    try:
        verdict = json.loads(result.private_output)
        valid = (verdict["secret"] == secret and verdict["total"] == len(tests)
                 and isinstance(verdict["passed"], int) and isinstance(verdict["failure"], str))
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        why = "timed out" if result.timed_out else f"exit status {result.exit_code}"
        return TestReport(0, len(tests), f"no verdict from the test harness ({why})", result)
    return TestReport(verdict["passed"], len(tests), verdict["failure"], result)

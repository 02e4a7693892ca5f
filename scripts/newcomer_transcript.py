"""Regenerates docs/newcomer.md: what a newcomer sees on typing the README's commands.

Every command of README.md's shell blocks (```bash, ```sh, ```shell), in the README's order, runs in a fresh
`git clone` of this checkout's HEAD, one after another, each from the clone's root in its own process group. Each
command's combined stdout and stderr is captured for its first --seconds (a command that ends sooner is shown
whole); then it is stopped as Ctrl-C stops it, SIGINT to its process group, and after GRACE_S the group gets SIGKILL.
What it prints after the Ctrl-C is shown apart, and so is anything of it still running at the end (found by an
environment variable every process it started inherits), which is then killed by pid.

The commands run as typed in a plain shell: this process's environment without a virtual environment on PATH.
Lines that change a shell's state (source, ., export, cd) are run again before each later command, as they would
hold in the newcomer's shell. The clone's .venv is a symlink to this checkout's .venv: the README's own install
(scripts/env.sh's megarl_venv, with the test extras for scripts/test.sh) takes longer than this transcript's whole
budget on a 2-core machine. So that the clone's code is what runs (the linked venv's editable install points
here), the commands get PYTHONPATH=<the clone>; the clone's setup.py and pins.toml are dated back so that
megarl_venv does not reinstall into the shared venv, which needs both of its install stamps.

usage: .venv/bin/python scripts/newcomer_transcript.py [--seconds 30] [--out docs/newcomer.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from megarl.utils.processes import with_environment

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python scripts/newcomer_transcript.py"
GRACE_S = 30.0  # after Ctrl-C: a run ends the step in progress and shuts its workers down
SETTLE_S = 10.0  # after it ended: what it started in other process groups (Ray's) may still be exiting
SHELL_FENCES = ("bash", "sh", "shell")
STATE_WORDS = ("source", ".", "export", "cd")  # commands whose effect lasts in the newcomer's shell
MARKER = "MEGARL_NEWCOMER_TRANSCRIPT"  # inherited by every process a command starts
INSTALL_STAMPS = (".megarl-installed", ".megarl-installed[test]")  # scripts/env.sh's megarl_venv


def readme_commands(readme: str) -> list[str]:
    """The commands of `readme`'s shell blocks in order: one per line, a line ending in a backslash joined with the
    next, comment lines and trailing comments left out."""
    commands, fence, pending = [], None, ""
    for line in readme.splitlines():
        stripped = line.strip()
        if fence is None:
            if match := re.fullmatch(r"(`{3,}|~{3,})\s*([\w-]*).*", stripped):
                fence = (match.group(1), match.group(2).lower() in SHELL_FENCES)
            continue
        if stripped.startswith(fence[0]) and not stripped.strip(fence[0][0]):
            fence, pending = None, ""
            continue
        if not fence[1] or (not pending and (not stripped or stripped.startswith("#"))):
            continue
        pending += without_comment(stripped)
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        if pending.strip():
            commands.append(pending.strip())
        pending = ""
    return commands


def without_comment(line: str) -> str:
    """`line` up to a `#` that starts a shell comment (after a blank, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def documented_commands(doc: str) -> list[str]:
    """The commands docs/newcomer.md shows, in its order (its `## N. `command`` headings)."""
    return [m.group(2) for m in re.finditer(r"^## \d+\. (`+) (.*) \1$", doc, flags=re.MULTILINE)]


@dataclass
class Transcript:
    command: str
    captured: str  # the first `seconds` of output, or all of it
    after_stop: str  # printed after the Ctrl-C
    seconds: float  # how long it ran before it ended or was stopped
    status: int  # its exit status (-9: killed)
    stopped: bool  # it ran past `seconds` and got the Ctrl-C
    stop_s: float | None  # after the Ctrl-C: how long until it ended; None if it had to be killed
    leftovers: list[str]  # its processes still running after it ended or was killed


def run_command(command: str, prelude: list[str], cwd: Path, env: dict, seconds: float) -> Transcript:
    marker = uuid.uuid4().hex
    script = "\n".join(prelude + [command])
    process = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env | {MARKER: marker}, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    chunks: list[tuple[float, bytes]] = []
    started = time.monotonic()

    def read() -> None:
        while chunk := os.read(process.stdout.fileno(), 65536):
            chunks.append((time.monotonic(), chunk))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stop_s = None
    try:
        process.wait(timeout=seconds)
        ran = time.monotonic() - started
    except subprocess.TimeoutExpired:
        ran = time.monotonic() - started
        signal_group(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group
        try:
            process.wait(timeout=GRACE_S)
            stop_s = time.monotonic() - started - ran
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.wait()
    deadline = time.monotonic() + SETTLE_S
    while (leftovers := with_environment(MARKER, marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    reader.join(timeout=10)  # the pipe ends once nothing of it holds it open
    stop = started + ran
    before = b"".join(chunk for at, chunk in chunks if at <= stop)
    after = b"".join(chunk for at, chunk in chunks if at > stop)
    return Transcript(command, text(before), text(after), ran, process.returncode, ran >= seconds, stop_s,
                      [f"{pid} {command_line(pid)}" for pid in leftovers])


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # nothing of it is left
        pass


def text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "(gone)"


def newcomer_env(clone: Path) -> dict:
    """This process's environment as a plain shell has it (no virtual environment on PATH), the clone's code first."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venvs = {str(ROOT / ".venv" / "bin"), str(Path(sys.prefix) / "bin")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p not in venvs)
    env["PYTHONPATH"] = str(clone)
    return env


def make_clone(where: Path) -> Path:
    venv = ROOT / ".venv"
    missing = [stamp for stamp in INSTALL_STAMPS if not (venv / stamp).is_file()]
    if missing:
        sys.exit(f"{venv} lacks {', '.join(missing)}: run scripts/quickstart.sh and scripts/test.sh here once first")
    clone = where / "megarl"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    (clone / ".venv").symlink_to(venv)
    installed = min((venv / stamp).stat().st_mtime for stamp in INSTALL_STAMPS)
    for name in ("setup.py", "pins.toml"):  # older than the install: megarl_venv sees it done
        os.utime(clone / name, (installed - 1, installed - 1))
    return clone


def fence(body: str) -> str:
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}text\n{body.rstrip()}\n{ticks}" if body.strip() else "(no output)"


def code_span(command: str) -> str:
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", command)), default=0) + 1)
    return f"{ticks} {command} {ticks}"


def outcome(t: Transcript) -> str:
    if not t.stopped:
        return f"ended, exit status {t.status}"
    return f"stopped by Ctrl-C, exit status {t.status}" if t.stop_s is not None else "killed after Ctrl-C"


def section(n: int, t: Transcript, seconds: float) -> str:
    if not t.stopped:
        how = f"ended by itself after {t.seconds:.1f} s, exit status {t.status}: shown whole"
    elif t.stop_s is not None:
        how = (f"the first {seconds:g} s shown; then Ctrl-C (SIGINT to its process group), after which it ended in "
               f"{t.stop_s:.1f} s, exit status {t.status}")
    else:
        how = (f"the first {seconds:g} s shown; then Ctrl-C (SIGINT to its process group); still running "
               f"{GRACE_S:g} s later, so its group was killed (SIGKILL)")
    parts = [f"## {n}. {code_span(t.command)}", "", how, "", fence(t.captured)]
    if t.after_stop.strip():
        parts += ["", "After the Ctrl-C:", "", fence(t.after_stop)]
    if t.leftovers:
        parts += ["", f"Still running after it ended (killed by pid): {len(t.leftovers)}", "",
                  fence("\n".join(t.leftovers))]
    return "\n".join(parts)


def machine() -> str:
    cores = len(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown processor")
    return f"{platform.node()}: {cores} cores ({model}), {platform.system()} {platform.release()}"


def document(transcripts: list[Transcript], commit: str, load: float, minutes: float, seconds: float) -> str:
    header = [
        "# What a newcomer sees",
        "",
        f"Produced {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC at commit {commit} on "
        f"{machine()} (load average {load:.1f} when it began), in {minutes:.1f} min. Regenerate with "
        f"`{REGENERATE}` (from the repository root; tests/test_newcomer_transcript.py fails while this file's "
        "commands differ from README.md's).",
        "",
        f"Every command of README.md's shell blocks, in the README's order, run in a fresh `git clone` of that "
        f"commit from its root, one after another: the first {seconds:g} s of each one's output (stdout and stderr "
        "together, verbatim), then Ctrl-C; a command that ends sooner is shown whole. As typed in a plain shell: no "
        "virtual environment is active unless a README command activates one. The clone's `.venv` is a symlink to "
        "an installed one (the README's own install, `scripts/env.sh`, takes longer than this whole transcript on a "
        "2-core machine: over 18 minutes for the base install alone), so the install lines a fresh machine prints "
        "first are not shown; `PYTHONPATH` names the clone so that its code runs. How it is made: the docstring of "
        "scripts/newcomer_transcript.py.",
        "",
        "| # | command | seconds | how it ended |",
        "| --- | --- | --- | --- |",
    ]
    header += [f"| {n} | {code_span(t.command).replace('|', '&#124;')} | {t.seconds:.1f} | {outcome(t)} |"
               for n, t in enumerate(transcripts, start=1)]
    sections = [section(n, t, seconds) for n, t in enumerate(transcripts, start=1)]
    return "\n".join(header) + "\n\n" + "\n\n".join(sections) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="output captured per command")
    parser.add_argument("--out", default=str(ROOT / "docs" / "newcomer.md"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megarl-newcomer-") as where:
        clone = make_clone(Path(where))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                                check=True).stdout.strip()
        commands = readme_commands((clone / "README.md").read_text())
        env, prelude, transcripts = newcomer_env(clone), [], []
        began, load = time.monotonic(), os.getloadavg()[0]
        for n, command in enumerate(commands, start=1):
            print(f"[{n}/{len(commands)}] {command}", flush=True)
            transcripts.append(run_command(command, prelude, clone, env, args.seconds))
            if command.split()[0] in STATE_WORDS:
                prelude.append(command)
        minutes = (time.monotonic() - began) / 60
    Path(args.out).write_text(document(transcripts, commit, load, minutes, args.seconds))
    print(f"wrote {args.out} ({len(commands)} commands, {minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

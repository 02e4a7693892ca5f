"""agent.gateway.command's value: what it runs as and whether it can run (megarl/rollout/gateway_command.py runs it).
Apart from the section (gateway_section.py), so that validation imports it without the config fields' module."""

from __future__ import annotations

import shlex
import shutil


def command_argv(command: list[str] | str) -> list[str]:
    """The argv a command runs as: a list as it is, a string through the shell."""
    return ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)


def check_command(command, key: str = "agent.gateway.command") -> str | None:
    """Why `command` cannot run (None: it can, as far as this host tells): empty, not a string or a list of strings,
    or its executable is not found. A shell string's executable is its first word (unless that sets a variable)."""
    if isinstance(command, str):
        try:
            words = shlex.split(command)
        except ValueError as e:
            return f"{key}={command!r} is not a valid shell command: {e}"
        if not words:
            return f"{key} is empty: give the agent's command, an argv list or a shell string"
        executable = words[0] if "=" not in words[0] else None
    elif isinstance(command, list):
        if not command:
            return f"{key} is an empty list: give the agent's command, an argv list or a shell string"
        if not all(isinstance(word, str) and word for word in command):
            return f"{key}={command!r}: an argv list holds non-empty strings only"
        executable = command[0]
    else:
        return f"{key}={command!r}: expected an argv list or a shell string"
    if executable is not None and shutil.which(executable) is None:
        return f"{key}: executable {executable!r} not found (on PATH, or as a path to an executable file)"
    return None

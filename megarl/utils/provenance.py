"""Which source a result came from, for the JSON that benchmarks write."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_commit() -> str:
    """$MEGARL_COMMIT when set (the device machine's copy of the tree has no usable .git), else `git rev-parse
    HEAD` of this checkout, else "unknown". Only a hex commit id is taken from git: a copied tree without its
    objects answers with other text ("HEAD", "ref: refs/heads/main")."""
    if os.environ.get("MEGARL_COMMIT"):
        return os.environ["MEGARL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out if re.fullmatch(r"[0-9a-f]{40}", out) else "unknown"

"""Where megarl keeps what it builds once per machine (a converted model, a helper environment): $MEGARL_CACHE, else
~/.cache/megarl. Light to import: scripts that only need the path load nothing else of megarl."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MEGARL_CACHE") or Path.home() / ".cache" / "megarl")

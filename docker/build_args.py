"""The Dockerfile's build arguments, from pins.toml (the one file that names versions).

    python3 docker/build_args.py      # prints --build-arg NAME=value lines for docker/build.sh

SGLang's official image is tagged v<version>-cu<CUDA>; pins.gpu.sglang is built for CUDA 13.
"""

import sys
import tomllib
from pathlib import Path

PINS_FILE = Path(__file__).resolve().parent.parent / "pins.toml"
CUDA_TAG = "cu130"
# build argument -> key in pins.toml's [gpu] section
GPU_PINS = {"TRANSFORMER_ENGINE_VERSION": "transformer-engine", "APEX_REF": "apex"}


def base_image(pins: dict) -> str:
    return f"lmsysorg/sglang:v{pins['gpu']['sglang']}-{CUDA_TAG}"


def build_args(pins: dict) -> dict[str, str]:
    gpu = pins["gpu"]
    missing = [key for key in GPU_PINS.values() if key not in gpu]
    if missing:
        raise KeyError(f"pins.toml [gpu] lacks {', '.join(missing)}: the image pins them there")
    return {"SGLANG_IMAGE": base_image(pins),
            "TORCH_VERSION": gpu["torch"]} | {arg: gpu[key] for arg, key in GPU_PINS.items()}


if __name__ == "__main__":
    try:
        args = build_args(tomllib.loads(PINS_FILE.read_text()))
    except KeyError as e:
        sys.exit(f"docker/build_args.py: {e.args[0]}")
    for name, value in args.items():
        print("--build-arg")
        print(f"{name}={value}")

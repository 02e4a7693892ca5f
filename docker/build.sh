#!/usr/bin/env bash
# Build the megarl GPU image with every version taken from pins.toml. Extra arguments go to docker build:
#   bash docker/build.sh -t megarl:dev [--build-arg BUILD_APEX=0]
set -euo pipefail
cd "$(dirname "$0")/.."
build_args=$(python3 docker/build_args.py)
mapfile -t args <<<"$build_args"
DOCKER_BUILDKIT=1 exec docker build -f docker/Dockerfile "${args[@]}" "$@" .

#!/usr/bin/env bash
# Installs the test extras into .venv and runs the suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
megarl_venv test
exec python -m pytest -q tests "$@"

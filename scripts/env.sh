# Sourced by the scripts: one place for the virtual environment and the run-time environment.

# Create .venv if needed and install megarl into it; `megarl_venv test` adds the test extras.
# torch comes first and pinned (pins.toml [cpu]): a CPU build of that version is on local disk,
# any other version would download gigabytes of CUDA wheels.
megarl_venv() {
  local extra=${1:+[$1]}
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
  local torch_pin
  torch_pin=$(python - <<'PY'
import tomllib
print(tomllib.load(open("pins.toml", "rb"))["cpu"]["torch"])
PY
)
  local stamp=".venv/.megarl-installed$extra"
  if [ ! -f "$stamp" ] || [ "$stamp" -ot setup.py ] || [ "$stamp" -ot pins.toml ]; then
    python -m pip install -q --upgrade pip
    python -m pip install -q "torch==$torch_pin"
    python -m pip install -q -e ".$extra"
    touch "$stamp"
  fi
}

# No hub access at run time: models and data come from local paths.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# Ray: no usage reporting; dashboard and services on loopback.
export RAY_USAGE_STATS_ENABLED=0
export PYTHONUNBUFFERED=1

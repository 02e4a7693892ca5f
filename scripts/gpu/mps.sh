# Sourced by GPU scripts: MPS=1 runs every CUDA process of the call under NVIDIA's Multi-Process Service, so the
# kernels of the trainer and of the colocated SGLang server can run side by side on one GPU (without MPS the device
# time-slices between processes). Starts a control daemon with its own pipe and log directories (exported: every
# child process, Ray's workers and SGLang's included, connects through them) and quits it when the script exits.
# The GPU's own settings (compute mode) are left as they are.
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/megarl-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/megarl-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! command -v nvidia-cuda-mps-control >/dev/null || ! nvidia-cuda-mps-control -d; then
    echo "MPS=1: could not start nvidia-cuda-mps-control (not installed here, or refused)" >&2
    exit 3
  fi
  trap 'echo quit | nvidia-cuda-mps-control; tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null' EXIT
  echo "MPS: control daemon started (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
fi

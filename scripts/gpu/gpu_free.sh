# Sourced by the GPU scripts: print the GPU memory in use before anything starts and warn loudly when it
# is more than ~1 GB (a leftover from an earlier call, e.g. an SGLang server: it skews every number), and any
# process of an earlier run.
# Also written to $OUT/gpu_start.txt (the start of a long log may not come back).
gpu_memory_check() {
  nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i $CUDA_VISIBLE_DEVICES} --query-gpu=index,memory.used --format=csv,noheader,nounits | while IFS=', ' read -r gpu used; do
    echo "GPU $gpu: ${used} MiB in use at start"
    if [ "${used:-0}" -gt 1024 ]; then
      echo "!!!!! WARNING: GPU $gpu has ${used} MiB in use before this run: a leftover process (numbers below are"
      echo "!!!!! measured beside it). GPU processes now:"
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | sed 's/^/!!!!!   /'
    fi
  done
  # A run an earlier call's `timeout` cut can outlive it (timeout signals its child only; Ray and SGLang run in
  # sessions of their own): with no GPU memory left in use it still holds ports, CPUs and disk.
  local left
  left=$(pgrep -af 'sglang\.launch_server|megarl\.train|raylet|gcs_server')  # not this script (scripts/gpu/sglang.sh)
  if [ -n "$left" ]; then
    echo "!!!!! WARNING: processes of an earlier run are still here (numbers below are measured beside them):"
    echo "$left" | cut -c1-200 | sed 's/^/!!!!!   /'
  fi
}
gpu_memory_check 2>&1 | tee "$OUT/gpu_start.txt"

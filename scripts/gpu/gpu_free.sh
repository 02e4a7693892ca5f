# Sourced by the GPU scripts: print the GPU memory in use before anything starts and warn loudly when it
# is more than ~1 GB (a leftover from an earlier call, e.g. an SGLang server: it skews every number).
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
}
gpu_memory_check 2>&1 | tee "$OUT/gpu_start.txt"

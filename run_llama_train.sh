#!/usr/bin/env bash
# Train on one node with torchrun.
#   NGPU         processes to start (default: the GPUs present, else 2 CPU processes)
#   CONFIG_FILE  a TOML config: a path or a name in train_configs/ (default: debug_model.toml)
#   LOG_RANK     the rank whose output is shown (default 0); the others write only warnings
#   PYTORCH_CUDA_ALLOC_CONF  default expandable_segments:True unless it, PYTORCH_ALLOC_CONF or
#                PYTORCH_HIP_ALLOC_CONF is set (set one empty for torch's own default)
#   Any argument is passed on to train.py as an override, e.g. --training.steps 10
# Example: NGPU=8 CONFIG_FILE=llama_8b.toml ./run_llama_train.sh --training.steps 100
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${NGPU:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L | wc -l)
  else
    NGPU=2
  fi
fi
CONFIG_FILE=${CONFIG_FILE:-debug_model.toml}
LOG_RANK=${LOG_RANK:-0}
export LOG_RANK

# CPU processes share the cores: give each its share of threads instead of oversubscribing,
# and let idle OpenMP threads sleep: spinning threads of one rank starve the other ranks
# (measured 3-4x slower steps on a loaded 2-core machine without PASSIVE).
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc)
  OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
  export OMP_NUM_THREADS
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Expandable segments let the CUDA caching allocator grow a segment in place instead of reserving
# new ones, so memory does not fragment into allocation retries and OOMs as tensor sizes vary.
# A setting of yours under any of torch's names is kept. CPU runs ignore it.
if [ -z "${PYTORCH_ALLOC_CONF+1}${PYTORCH_CUDA_ALLOC_CONF+1}${PYTORCH_HIP_ALLOC_CONF+1}" ]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi

exec torchrun --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"

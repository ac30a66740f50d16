#!/usr/bin/env bash
# Train on one node with torchrun.
#   NGPU         processes to start (default: the GPUs present, else 2 CPU processes)
#   CONFIG_FILE  a TOML config: a path or a name in train_configs/ (default: debug_model.toml)
#   LOG_RANK     the rank whose output is shown (default 0); the others write only warnings
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

exec torchrun --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"

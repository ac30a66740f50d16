#!/usr/bin/env bash
# Stop the cluster started by start_cluster.sh: only our daemons, by the pids in WORKDIR
# (munged only when start_cluster.sh started it). Safe to run twice.
set -uo pipefail
W=${WORKDIR:?set WORKDIR to the folder given to start_cluster.sh}
for f in "$W/slurmd.pid" "$W/slurmctld.pid" "$W/munged.pid"; do
  [ -s "$f" ] || continue
  pid=$(cat "$f")
  rm -f "$f"  # a second run must not signal a recycled pid
  kill -TERM "$pid" 2>/dev/null || continue
  for _ in $(seq 100); do  # up to 10 s, then give up on a graceful stop
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
done

#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine (for CI and local testing of the sbatch script).
#   WORKDIR        scratch folder for slurm.conf, state, spool, logs and pid files (required)
#   SLURMCTLD_PORT controller port (default 6817); set both ports to run two clusters on one host
#   SLURMD_PORT    node daemon port (default 6818)
#   FAKE_GPUS      GPUs the node advertises (default 8; 0 = none), so a script that asks for
#                  --gpus-per-node=8 runs on a CPU machine. Their device files are links to
#                  /dev/null: slurm only counts and hands them out, nothing opens them.
#   GRACE_TIME     GraceTime of the partition `preemptible` (default 60): a job there that a job
#                  of the partition `urgent` preempts gets SIGTERM, this many seconds, SIGKILL,
#                  and is requeued. The default partition `debug` is never preempted.
# Needs root and the Debian packages slurmctld slurmd slurm-client munge. Works without systemd:
# the daemons are started by hand and write pid files, which stop_cluster.sh uses.
# Afterwards every shell that talks to the cluster needs: export SLURM_CONF=$WORKDIR/slurm.conf
set -euo pipefail
W=${WORKDIR:?set WORKDIR to a scratch folder}
CTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
FAKE_GPUS=${FAKE_GPUS:-8}
GRACE_TIME=${GRACE_TIME:-60}
mkdir -p "$W"/state "$W"/spool "$W"/log

# munge authenticates every message. The package makes the key; create one if it is missing.
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 600 /etc/munge/munge.key
fi
# One munged serves the whole host: start it only if none answers, and remember that we did so
# stop_cluster.sh leaves alone a munged that was already running.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge  # systemd's RuntimeDirectory; absent without it
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$W/munged.pid"
  munge -n | unmunge >/dev/null
fi

host=$(hostname -s)
# RealMemory above the real memory marks the node invalid: declare 90 % of it.
mem=$(( $(free -m | awk '/^Mem:/{print $2}') * 9 / 10 ))
node=$(slurmd -C | head -n1 | sed -E "s/RealMemory=[0-9]+/RealMemory=$mem/")
gres_types="" node_gres=""
: > "$W/gres.conf"  # slurmd reads gres.conf next to slurm.conf
if [ "$FAKE_GPUS" -gt 0 ]; then
  for ((i = 0; i < FAKE_GPUS; i++)); do ln -sfn /dev/null "$W/fakegpu$i"; done
  # slurm drops a GPU without a device File, and wants a character device: /dev/null is one.
  echo "Name=gpu File=$W/fakegpu[0-$((FAKE_GPUS - 1))]" > "$W/gres.conf"
  gres_types="GresTypes=gpu" node_gres="Gres=gpu:$FAKE_GPUS"
fi
# cred_expire=10 and sched_interval=2 make a requeued job start again in ~15 s instead of ~150 s.
cat > "$W/slurm.conf" <<CONF
ClusterName=titanlite-ci
$gres_types
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd.pid
SlurmctldLogFile=$W/log/slurmctld.log
SlurmdLogFile=$W/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
$node $node_gres NodeAddr=127.0.0.1 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
PartitionName=preemptible Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
export SLURM_CONF=$W/slurm.conf
slurmctld  # both daemonize and write their pid files
slurmd
for _ in $(seq 60); do
  [ "$(sinfo -h -o %t)" = idle ] && break
  sleep 0.5
done
state=$(sinfo -h -o %t)
if [ "$state" != idle ]; then
  echo "start_cluster.sh: node state is '$state', not idle; see $W/log/" >&2
  exit 1
fi
echo "SLURM_CONF=$W/slurm.conf"

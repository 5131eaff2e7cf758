#!/usr/bin/env bash
# Stop the local Slurm that slurm/local/up.sh started: cancel its jobs first, then stop only the
# daemons whose PID files up.sh's config (or up.sh itself, for munged) wrote.
set -uo pipefail

STATE=${MEMTRAIN_SLURM_DIR:-/var/tmp/memtrain-slurm}
export SLURM_CONF=$STATE/slurm.conf

stop() {  # stop <pidfile> <name>: SIGTERM the process if it is that daemon, wait up to 10 s
  local pidfile=$1 name=$2 pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "memtrain-slurm: $name ($pid) ignored SIGTERM; killing" >&2; kill -9 "$pid"; }
    echo "stopped: $name"
  fi
  rm -f "$pidfile"
}

if [[ -s $STATE/pid/slurmctld.pid ]] && kill -0 "$(cat "$STATE/pid/slurmctld.pid")" 2>/dev/null; then
  jobs=$(squeue -h -o %i 2>/dev/null)
  if [[ -n $jobs ]]; then
    scancel $jobs
    for _ in $(seq 100); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
  fi
fi
stop "$STATE/pid/slurmd.pid" slurmd
stop "$STATE/pid/slurmctld.pid" slurmctld
stop "$STATE/run/munged.pid" munged

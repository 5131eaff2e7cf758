#!/usr/bin/env bash
# A real single-host Slurm (munge + slurmctld + slurmd) for tests and CI, from Debian's packages.
#
#   slurm/local/up.sh            install if missing, write the config, start what is not running
#   export SLURM_CONF=/var/tmp/memtrain-slurm/slurm.conf   # then sbatch/squeue/... use it
#   slurm/local/down.sh          cancel its jobs, stop the daemons this script started
#
# Idempotent. Prints "started: <daemon>" for each daemon it starts. Exit 0: the node is idle
# and takes jobs; exit 3: Slurm cannot be installed or started here (reason on stderr).
# The config is private (its own directory and ports), so a system Slurm is never touched.
set -euo pipefail

STATE=${MEMTRAIN_SLURM_DIR:-/var/tmp/memtrain-slurm}
CONF=$STATE/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge)

cannot() { echo "memtrain-slurm: cannot run a local Slurm: $*" >&2; exit 3; }
alive() { [[ -s $1 && $(cat "/proc/$(cat "$1")/comm" 2>/dev/null) == "$2" ]]; }  # alive PIDFILE NAME

# --- install (root + apt only; nothing else is guessed)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  [[ $(id -u) == 0 ]] || cannot "Slurm is not installed and installing it needs root (apt-get install ${PACKAGES[*]})"
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get to install it"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1; } \
    || cannot "apt-get install ${PACKAGES[*]} failed (no package mirror reachable?)"
fi
if [[ $(id -u) != 0 ]]; then  # enough for a cluster that is already up; starting one needs root
  alive "$STATE/pid/slurmctld.pid" slurmctld && alive "$STATE/pid/slurmd.pid" slurmd && { echo "SLURM_CONF=$CONF"; exit 0; }
  cannot "starting slurmctld/slurmd needs root"
fi

# --- munge: reuse a working one, else start ours (as the munge user; the package made the key)
mkdir -p "$STATE/run" "$STATE/log"
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || cannot "/etc/munge/munge.key is missing"
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null 2>&1 || cannot "munged did not start"
  cp /run/munge/munged.pid "$STATE/run/munged.pid"
  echo "started: munged"
fi

# --- config: this host as the only node, sized from what slurmd itself detects
host=$(hostname -s)
node=$(slurmd -C | head -1)  # NodeName=<host> CPUs=.. Boards=.. ... RealMemory=.. (line 2: UpTime)
install -d -o slurm -g slurm "$STATE/ctld" "$STATE/pid"
install -d "$STATE/spool"
cat > "$CONF.new" <<CONF
# Written by slurm/local/up.sh: a single-host cluster for memtrain's tests.
ClusterName=memtrain
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only after cred_expire seconds (default 120).
AuthInfo=cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/pid/slurmctld.pid
SlurmdPidFile=$STATE/pid/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No cgroups on these machines.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Reject impossible requests at submit time instead of leaving them pending forever.
EnforcePartLimits=ALL
# Start jobs at once; the periodic pass (what starts a requeued job) every 2 s, not 60 s.
SchedulerParameters=batch_sched_delay=0,sched_interval=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=300
KillWait=30
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
mv "$CONF.new" "$CONF"
chmod 0644 "$CONF"
export SLURM_CONF=$CONF

# --- daemons (their PID files live in our state directory, so down.sh stops only these)
if ! alive "$STATE/pid/slurmctld.pid" slurmctld; then
  /usr/sbin/slurmctld -f "$CONF" || cannot "slurmctld did not start (see $STATE/log/slurmctld.log)"
  echo "started: slurmctld"
  # Jobs recovered from the state of a session that ended without down.sh would start now: drop them.
  stale=
  for _ in $(seq 50); do stale=$(squeue -h -o %i 2>/dev/null) && break; sleep 0.1; done
  [[ -z $stale ]] || { echo "cancelling jobs left from an earlier session: $stale" | tr '\n' ' '; echo; scancel $stale; }
fi
if ! alive "$STATE/pid/slurmd.pid" slurmd; then
  /usr/sbin/slurmd -f "$CONF" || cannot "slurmd did not start (see $STATE/log/slurmd.log)"
  echo "started: slurmd"
fi

# --- wait until the node takes jobs
for _ in $(seq 100); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  [[ $state == idle || $state == mixed || $state == allocated ]] && { echo "SLURM_CONF=$CONF"; exit 0; }
  sleep 0.2
done
cannot "node $host is '${state:-unknown}', not idle, after 20 s (see $STATE/log/)"

#!/usr/bin/env bash
# A real SLURM on this machine (Debian, root), and launchers/slurm_laminar.sbatch on it: one node
# (this host), or NODES=K nodes, each a network namespace of its own on a private bridge.
# Run from the repository root, with `laminar` and `torchrun` on PATH (e.g. . .venv/bin/activate):
#
#   launchers/slurm_local.sh up        # apt-get install slurm-wlm munge; start munged, slurmctld, slurmd
#   launchers/slurm_local.sh submit    # sbatch configs/slurm_cpu.yaml (sim engines, 20 steps) and
#                                      # wait: the job must exit 0; then the leftover check
#   launchers/slurm_local.sh cancel    # sbatch, scancel once the trainer has stepped, leftover check
#   launchers/slurm_local.sh down      # stop the daemons `up` started
#
# Everything lives in SLURM_LOCAL_DIR (default /tmp/laminar-slurm, or -nK): slurm.conf (export
# SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf to use sinfo/squeue/sbatch yourself), state, logs,
# pid files. The node is this host (NodeName from `hostname -s`), its NodeAddr the first
# global IPv4 address (else 127.0.0.1), CPUs and memory as the machine has them, no GPUs:
# the job is submitted with --gpus-per-node=0 and ROLLOUTS_PER_NODE (default 2) CPU rollouts.
# NODES=K (K >= 2): slurmctld in namespace lamslurm-c (10.77.0.2) and slurmd nodeI in namespace
# lamslurm-I (10.77.0.(10+I)), veth pairs on bridge lamslurm-br (no address in this host's own
# namespace); the client commands run in lamslurm-c. `down` removes the namespaces and the bridge.
# The leftover check after a job: no process of the job (SLURM_JOB_ID in its environment), no
# /dev/shm segment and no unix socket named after the run, no ipc directory.
set -uo pipefail

NODES=${NODES:-1}
if (( NODES > 1 )); then DIR=${SLURM_LOCAL_DIR:-/tmp/laminar-slurm-n$NODES}; else DIR=${SLURM_LOCAL_DIR:-/tmp/laminar-slurm}; fi
NS=lamslurm
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
CONFIG=${CONFIG:-configs/slurm_cpu.yaml}
ROLLOUTS_PER_NODE=${ROLLOUTS_PER_NODE:-2}
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-600}

say() { echo "slurm_local: $*" >&2; }
die() { say "$*"; exit 1; }

# wait_for SECONDS WHAT CMD...: poll CMD every 0.5 s until it succeeds; fail after SECONDS
wait_for() {
  local limit=$1 what=$2 deadline
  shift 2
  deadline=$(( SECONDS + limit ))
  until "$@" >/dev/null 2>&1; do
    (( SECONDS < deadline )) || { say "timed out after ${limit}s waiting for $what"; return 1; }
    sleep 0.5
  done
}

# sl CMD...: a SLURM client command, in the controller's namespace when the nodes have their own
sl() { if (( NODES > 1 )); then in_ns c "$@"; else "$@"; fi; }
# in_ns NAME CMD...: CMD in network namespace $NS-NAME (only the network: `ip netns exec` would
# also remount /sys, hiding the cgroup filesystem slurmd needs)
in_ns() { local ns=$1; shift; nsenter --net="/run/netns/$NS-$ns" "$@"; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm and munge by hand"
  (( EUID == 0 )) || die "installing slurm-wlm needs root"
  say "installing slurm-wlm and munge (Debian packages)"
  apt-get update -q || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 slurm-wlm munge \
    || die "apt-get install slurm-wlm munge failed"
}

start_munge() {
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile=/etc/munge/munge.key
    else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already running"
    return 0
  fi
  runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/munged.log)"
  touch "$DIR/started-munged"
  wait_for 20 munged bash -c 'munge -n | unmunge' || die "munge does not answer"
}

write_conf() {
  local node addr cpus mem i
  node=$(hostname -s)
  addr=$(ip -o -4 addr show scope global 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
  addr=${addr:-127.0.0.1}
  (( NODES > 1 )) && addr=10.77.0.2
  cpus=$(nproc --all)
  mem=$(awk -v n="$NODES" '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
  mkdir -p "$DIR/state"
  cat > "$CONF" <<EOF
# written by launchers/slurm_local.sh: $NODES node(s) on this host, no GPUs, no cgroups
ClusterName=laminar-local
SlurmctldHost=${node}(${addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=30
EOF
  if (( NODES > 1 )); then
    for (( i = 0; i < NODES; i++ )); do
      echo "NodeName=node$i NodeAddr=10.77.0.$((10 + i)) CPUs=${cpus} RealMemory=${mem} State=UNKNOWN" >> "$CONF"
    done
  else
    echo "NodeName=${node} NodeAddr=${addr} CPUs=${cpus} RealMemory=${mem} State=UNKNOWN" >> "$CONF"
  fi
  echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
  say "wrote $CONF ($NODES node(s), controller at $addr, $cpus CPUs each)"
}

# netns_up: the controller's and every node's namespace, joined by veth pairs on one bridge
netns_up() {
  local names=(c) n i=0
  for (( n = 0; n < NODES; n++ )); do names+=("$n"); done
  ip link show "$NS-br" >/dev/null 2>&1 || ip link add "$NS-br" type bridge || die "cannot make bridge $NS-br"
  ip link set "$NS-br" up
  for n in "${names[@]}"; do
    ip netns list | grep -qw "$NS-$n" && continue
    ip netns add "$NS-$n" || die "cannot make network namespace $NS-$n"
    ip link add "$NS-v$n" type veth peer name eth0 netns "$NS-$n"
    ip link set "$NS-v$n" master "$NS-br" up
    if [[ $n == c ]]; then i=2; else i=$((10 + n)); fi
    ip -n "$NS-$n" addr add "10.77.0.$i/24" dev eth0
    ip -n "$NS-$n" link set eth0 up
    ip -n "$NS-$n" link set lo up
  done
}

netns_down() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^$NS-"); do
    ip netns del "$ns"
  done
  if ip link show "$NS-br" >/dev/null 2>&1; then ip link del "$NS-br"; fi
  return 0
}

up() {
  local i
  install
  (( EUID == 0 )) || die "starting slurmctld/slurmd as written needs root"
  mkdir -p "$DIR"
  start_munge
  write_conf
  if (( NODES > 1 )); then
    netns_up
    pid_alive "$DIR/slurmctld.pid" || in_ns c slurmctld -f "$CONF" \
      || die "slurmctld did not start (see $DIR/slurmctld.log)"
    for (( i = 0; i < NODES; i++ )); do
      pid_alive "$DIR/slurmd-node$i.pid" || { mkdir -p "$DIR/spool-node$i"; in_ns "$i" slurmd -f "$CONF" -N "node$i"; } \
        || die "slurmd node$i did not start (see $DIR/slurmd-node$i.log)"
    done
  else
    pid_alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/slurmctld.log)"
    mkdir -p "$DIR/spool-$(hostname -s)"
    pid_alive "$DIR/slurmd-$(hostname -s).pid" || slurmd -f "$CONF" -N "$(hostname -s)" \
      || die "slurmd did not start (see $DIR/slurmd-$(hostname -s).log)"
  fi
  wait_for 90 "every node to be idle" all_idle || { sl sinfo -N -l >&2; die "the nodes did not come up"; }
  sl sinfo -N -l >&2
  if (( NODES > 1 )); then
    say "up; use it with: export SLURM_CONF=$CONF; nsenter --net=/run/netns/$NS-c sinfo"
  else
    say "up; use it with: export SLURM_CONF=$CONF"
  fi
}

all_idle() { [[ $(sl sinfo -h -N -o %t | grep -cx idle) == "$NODES" ]]; }

down() {
  local f pid
  for f in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
    pid_alive "$f" || continue
    pid=$(cat "$f")
    kill -TERM "$pid"
    wait_for 30 "$(basename "$f" .pid) to stop" bash -c "! kill -0 $pid" || kill -KILL "$pid"
    say "stopped $(basename "$f" .pid)"
  done
  if [[ -f $DIR/started-munged ]] && pid_alive /run/munge/munged.pid; then
    kill -TERM "$(cat /run/munge/munged.pid)"
    rm -f "$DIR/started-munged"
    say "stopped munged"
  fi
  if (( NODES > 1 )); then netns_down; say "removed the namespaces and the bridge ($NS-*)"; fi
  return 0
}

# leftovers NAME JOB: print every process, shm segment, socket or ipc dir the job left; 1 if any
leftovers() {
  local name=$1 job=$2 found=0 p
  for p in $(job_pids "$job"); do
    say "left: process $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null)"
    found=1
  done
  while read -r p; do
    say "left: shm segment $p"; found=1
  done < <(find /dev/shm -maxdepth 1 -name "*${name}*" 2>/dev/null)
  while read -r p; do
    say "left: unix socket $p"; found=1
  done < <(awk -v n="$name" 'NR > 1 && index($NF, n) {print $NF}' /proc/net/unix)
  for p in /tmp/laminar-"${name}"-*; do
    [[ -e $p ]] && { say "left: ipc directory $p"; found=1; }
  done
  (( found == 0 )) && say "leftover check: no process, shm segment, unix socket or ipc directory of job $job ($name)"
  return "$found"
}

# job_pids JOB: processes with SLURM_JOB_ID=JOB in their environment (the job's steps and children)
job_pids() {
  grep -lsxz "SLURM_JOB_ID=$1" /proc/[0-9]*/environ | awk -F/ '{print $3}'
}
no_job_pids() { [[ -z $(job_pids "$1") ]]; }

job_state() { sl scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p'; }
job_gone() { local s; s=$(job_state "$1"); [[ -z $s || $s =~ ^(COMPLETED|CANCELLED|FAILED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)$ ]]; }

# submit_job NAME [key=value ...]: sbatch the launcher; prints the job id
submit_job() {
  local name=$1
  shift
  mkdir -p runs
  [[ -s runs/slurm-cpu-prompts.jsonl ]] || for i in $(seq 0 3999); do
    printf '{"prompt": "prompt %05d"}\n' "$i"
  done > runs/slurm-cpu-prompts.jsonl
  sl sbatch --parsable --nodes="$NODES" --gpus-per-node=0 --output="runs/$name.out" \
    --export="ALL,ROLLOUTS_PER_NODE=$ROLLOUTS_PER_NODE,RUN_DIR=runs/$name,STOP_TIMEOUT_S=20" \
    launchers/slurm_laminar.sbatch "$CONFIG" "name=$name" "$@"
}

submit() {
  local name job t0 rc state
  name=slurm-local-$(date +%s)
  t0=$(date +%s%N)
  job=$(submit_job "$name" "$@") || die "sbatch failed"
  say "job $job submitted ($name); output runs/$name.out"
  wait_for "$JOB_TIMEOUT_S" "job $job to end" job_gone "$job" || { sl scancel "$job"; die "job $job did not end"; }
  state=$(job_state "$job")
  rc=$(sl scontrol show job -o "$job" | tr ' ' '\n' | sed -n 's/^ExitCode=//p')
  say "job $job: $state, exit code $rc, wall-clock $(( ($(date +%s%N) - t0) / 1000000 )) ms (submit to end)"
  wait_for 30 "the job's processes to go" no_job_pids "$job" || true
  leftovers "$name" "$job"; local left=$?
  [[ $state == COMPLETED && $rc == 0:0 ]] && (( left == 0 ))
}

cancel() {
  local name job
  name=slurm-local-cancel-$(date +%s)
  job=$(submit_job "$name" trainer.total_steps=100000 "$@") || die "sbatch failed"
  say "job $job submitted ($name); cancelling once the trainer has stepped"
  wait_for 300 "the trainer's first steps" bash -c "[[ -s runs/$name/metrics.jsonl ]]" \
    || { sl scancel "$job"; die "the trainer never stepped (see runs/$name.out)"; }
  say "trainer stepping; shm segments now: $(find /dev/shm -maxdepth 1 -name "*${name}*" | wc -l)"
  sl scancel "$job"
  wait_for 120 "job $job to end after scancel" job_gone "$job" || die "job $job did not end"
  say "job $job: $(job_state "$job")"
  wait_for 60 "the job's processes to go" no_job_pids "$job" || true
  leftovers "$name" "$job"
}

cd "$(dirname "$0")/.." || exit 1
case ${1:-} in
  up) up ;;
  down) down ;;
  submit) shift; submit "$@" ;;
  cancel) shift; cancel "$@" ;;
  *) echo "usage: launchers/slurm_local.sh up | submit [key=value ...] | cancel [key=value ...] | down" >&2; exit 2 ;;
esac

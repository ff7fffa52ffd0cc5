#!/usr/bin/env bash
# Per-host daemons without SLURM (systemd units, tmux panes, or this script).
# Host 0 runs manager + buffer + trainer; every host runs one relay and its rollouts.
#
#   laminar keys /shared/keys      # once, on a directory every host can read
#   HOST_INDEX=0 HOST_IPS=10.0.0.1,10.0.0.2 GPUS=8 KEYS_DIR=/shared/keys \
#       ./launchers/host_daemons.sh configs/qwen2.5-7b-vllm.yaml
#   HOST_INDEX=1 HOST_IPS=10.0.0.1,10.0.0.2 GPUS=8 KEYS_DIR=/shared/keys \
#       ./launchers/host_daemons.sh configs/qwen2.5-7b-vllm.yaml
#
# Environment (every host the same config, the same HOST_IPS and the same keys):
#   HOST_INDEX   this host's place in HOST_IPS (0 = the head: manager, buffer, trainer)
#   HOST_IPS     comma list of every host's address, in HOST_INDEX order; when set the nodes
#                talk tcp: manager/buffer/trainer at HEAD_IP, relay i at host i, and
#                cluster.roles.relay = the number of hosts. Unset: one host, the config's transport
#   HEAD_IP      the head's address (default: the first of HOST_IPS)
#   BASE_PORT    first tcp port (default 15550, the config's layout)
#   KEYS_DIR     `laminar keys` directory: CURVE on every tcp socket
#   GPUS         GPUs on this host (default 0: CUDA_VISIBLE_DEVICES left alone); host 0 gives the first TRAINER_GPUS to the
#                trainer (default GPUS/2; torchrun over them), each rollout GPUS_PER_ROLLOUT of
#                the rest (launchers/on_gpus.sh sets each process's CUDA_VISIBLE_DEVICES)
#   ROLLOUTS     rollout processes on this host (default: the GPUs left, or 1 on CPU); rollout
#                indices are HOST_INDEX * ROLLOUTS .. + ROLLOUTS - 1 (the same ROLLOUTS everywhere)
#   TRAINER_PROCS trainer ranks on host 0 (default max(TRAINER_GPUS, 1); > 1: torchrun --standalone)
#
# Supervision, the same policy as `laminar run` (laminar/children.py): a node that dies
# (crash, kill -9, or exiting by itself) is restarted after BACKOFF_S seconds, doubling per
# restart of that node within RESTART_WINDOW_S, capped at BACKOFF_MAX_S; the other nodes keep
# running. More than MAX_RESTARTS deaths of one node within RESTART_WINDOW_S, or one exit
# with code 3 (EXIT_PERMANENT: e.g. nothing to train), stop every node of the host (exit 1,
# naming the node); MAX_RESTARTS=0 stops them all at the first death. The trainer exiting 0
# is the job done: the host stops, exit 0.
# SIGTERM/SIGINT stop in order: trainer, rollouts, buffer, relay, manager (each node gets
# STOP_TIMEOUT_S to drain, then SIGKILL); exit 128 + the signal.
# Defaults mirror cluster.restart in the config; override them in the environment.
set -uo pipefail  # no -e: a failing command must not skip stopping the other nodes
CONFIG=${1:?usage: host_daemons.sh CONFIG [key=value ...]}; shift
HOST_INDEX=${HOST_INDEX:?set HOST_INDEX}
MAX_RESTARTS=${MAX_RESTARTS:-5}
RESTART_WINDOW_S=${RESTART_WINDOW_S:-600}
BACKOFF_S=${BACKOFF_S:-1}
BACKOFF_MAX_S=${BACKOFF_MAX_S:-30}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-15}
LAMINAR=${LAMINAR:-laminar}
TORCHRUN=${TORCHRUN:-torchrun}
ON_GPUS=${ON_GPUS:-$(dirname "$0")/on_gpus.sh}
BASE_PORT=${BASE_PORT:-15550}
GPUS=${GPUS:-0}
GPUS_PER_ROLLOUT=${GPUS_PER_ROLLOUT:-1}
TRAINER_GPUS=$(( HOST_INDEX == 0 ? ${TRAINER_GPUS:-$((GPUS / 2))} : 0 ))
TRAINER_PROCS=${TRAINER_PROCS:-$(( TRAINER_GPUS > 0 ? TRAINER_GPUS : 1 ))}
ROLLOUT_GPUS=$(( GPUS > 0 ? GPUS_PER_ROLLOUT : 0 ))
if (( GPUS > 0 )); then
  ROLLOUTS=${ROLLOUTS:-$(( (GPUS - TRAINER_GPUS) / GPUS_PER_ROLLOUT ))}
  if (( ROLLOUTS * GPUS_PER_ROLLOUT + TRAINER_GPUS > GPUS )); then
    echo "host_daemons: $ROLLOUTS rollouts x $GPUS_PER_ROLLOUT GPU(s) + $TRAINER_GPUS trainer GPU(s) > GPUS=$GPUS" >&2
    exit 2
  fi
else
  ROLLOUTS=${ROLLOUTS:-1}
fi

say() { echo "host_daemons: $*" >&2; }

# supervise NAME CMD...: run CMD, restart it when it dies, within the budget.
# Exits 0 when asked to stop (SIGTERM) or when the trainer finished; 1 when the budget is spent.
supervise() {
  local name=$1; shift
  local child=0 rc now delay stopping=0 restarts=0
  local -a recent=()
  trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM
  while :; do
    "$@" & child=$!
    say "started $name pid=$child (restarts: $restarts)"
    wait "$child"; rc=$?
    if (( stopping )); then
      local waited=0
      while kill -0 "$child" 2>/dev/null && (( waited < STOP_TIMEOUT_S * 10 )); do
        sleep 0.1; waited=$((waited + 1))
      done
      if kill -0 "$child" 2>/dev/null; then
        say "$name (pid $child) did not stop in ${STOP_TIMEOUT_S}s; killing it"
        kill -KILL "$child" 2>/dev/null
      fi
      wait "$child" 2>/dev/null
      exit 0
    fi
    if [[ $name == trainer* && $rc == 0 ]]; then
      say "$name finished"
      exit 0
    fi
    say "node $name (pid $child) exited with code $rc"
    if (( rc == 3 )); then  # EXIT_PERMANENT (laminar/supervise.py): a restart would fail the same way
      say "node $name failed in a way a restart cannot fix (exit 3, see its output)"
      exit 1
    fi
    now=$SECONDS
    local -a kept=()
    local t
    for t in "${recent[@]}"; do
      (( now - t <= RESTART_WINDOW_S )) && kept+=("$t")
    done
    recent=("${kept[@]}")
    if (( ${#recent[@]} >= MAX_RESTARTS )); then
      say "node $name: restart budget spent (${#recent[@]} restarts within ${RESTART_WINDOW_S}s, MAX_RESTARTS=$MAX_RESTARTS)"
      exit 1
    fi
    recent+=("$now")
    delay=$(( BACKOFF_S * (1 << (${#recent[@]} - 1)) ))
    (( delay > BACKOFF_MAX_S )) && delay=$BACKOFF_MAX_S
    restarts=$((restarts + 1))
    say "node $name: restart $restarts in ${delay}s (${#recent[@]}/$MAX_RESTARTS within ${RESTART_WINDOW_S}s)"
    sleep "$delay" & child=$!
    wait "$child"
    (( stopping )) && exit 0
  done
}

declare -A sup=()  # node name -> pid of its supervise loop
start() { local name=$1; shift; supervise "$name" "$@" & sup[$name]=$!; }
# start_on NAME FIRST COUNT CMD...: CMD on GPU slots FIRST.. (COUNT of them); GPUS=0: GPUs untouched
start_on() {
  local name=$1 first=$2 count=$3
  shift 3
  if (( GPUS > 0 )); then start "$name" "$ON_GPUS" "$first" "$count" "$@"; else start "$name" "$@"; fi
}

# stop_all: the ordered stop; every stage's drain may still need the stages after it
stop_all() {
  local stage name
  for stage in trainer rollout buffer relay manager; do
    for name in "${!sup[@]}"; do
      [[ $name == "$stage"* ]] || continue
      kill -TERM "${sup[$name]}" 2>/dev/null
      wait "${sup[$name]}" 2>/dev/null
      unset "sup[$name]"
    done
  done
}

signalled=0
trap 'signalled=143' TERM
trap 'signalled=130' INT

# tcp across hosts: every endpoint explicit, one relay per host
SETTINGS=()
if [[ -n ${HOST_IPS:-} ]]; then
  IFS=, read -r -a IPS <<< "$HOST_IPS"
  HEAD_IP=${HEAD_IP:-${IPS[0]}}
  if (( HOST_INDEX >= ${#IPS[@]} )); then
    echo "host_daemons: HOST_INDEX=$HOST_INDEX but HOST_IPS lists ${#IPS[@]} host(s)" >&2
    exit 2
  fi
  eps="{manager: 'tcp://${HEAD_IP}:${BASE_PORT}', buffer: 'tcp://${HEAD_IP}:$((BASE_PORT + 1))'"
  eps+=", trainer: 'tcp://${HEAD_IP}:$((BASE_PORT + 2))'"
  for i in "${!IPS[@]}"; do
    eps+=", relay-${i}: 'tcp://${IPS[$i]}:$((BASE_PORT + 10 + i))'"
    eps+=", relay_pub-${i}: 'tcp://${IPS[$i]}:$((BASE_PORT + 60 + i))'"
    eps+=", relay_data-${i}: 'tcp://${IPS[$i]}:$((BASE_PORT + 110 + i))'"
  done
  SETTINGS=("cluster.transport=tcp" "cluster.endpoints=${eps}}" "cluster.roles.relay=${#IPS[@]}"
            "cluster.roles.rollout=$(( ROLLOUTS * ${#IPS[@]} ))")
elif [[ -n ${HEAD_IP:-} ]]; then
  echo "host_daemons: HEAD_IP is set but HOST_IPS is not: list every host's address in HOST_IPS" >&2
  exit 2
fi
[[ -z ${KEYS_DIR:-} ]] || SETTINGS+=("security.keys_dir=${KEYS_DIR}")
# options first, then key=value: the launcher's settings, the user's, then each process's own
SETTINGS+=("$@")

if [ "$HOST_INDEX" = 0 ]; then
  start manager "$LAMINAR" node --role manager --config "$CONFIG" ${SETTINGS[@]+"${SETTINGS[@]}"}
  start buffer "$LAMINAR" node --role buffer --config "$CONFIG" ${SETTINGS[@]+"${SETTINGS[@]}"}
fi
start "relay-$HOST_INDEX" "$LAMINAR" node --role relay --index "$HOST_INDEX" --config "$CONFIG" \
  ${SETTINGS[@]+"${SETTINGS[@]}"}
for (( r = 0; r < ROLLOUTS; r++ )); do
  index=$(( HOST_INDEX * ROLLOUTS + r ))
  start_on "rollout-$index" $(( TRAINER_GPUS + r * ROLLOUT_GPUS )) "$ROLLOUT_GPUS" \
    "$LAMINAR" node --role rollout --index "$index" --config "$CONFIG" \
    ${SETTINGS[@]+"${SETTINGS[@]}"} "rollout.relay_index=${HOST_INDEX}"
done
if [ "$HOST_INDEX" = 0 ]; then
  if (( TRAINER_PROCS > 1 )); then
    start_on trainer 0 "$TRAINER_GPUS" "$TORCHRUN" --standalone --nproc_per_node "$TRAINER_PROCS" \
      -m laminar node --role trainer --config "$CONFIG" ${SETTINGS[@]+"${SETTINGS[@]}"}
  else
    start_on trainer 0 "$TRAINER_GPUS" "$LAMINAR" node --role trainer --config "$CONFIG" \
      ${SETTINGS[@]+"${SETTINGS[@]}"}
  fi
fi

code=0
while (( ! signalled )); do
  for name in "${!sup[@]}"; do
    pid=${sup[$name]}
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"; rc=$?
    unset "sup[$name]"
    if (( rc != 0 )); then
      say "$name: giving up; stopping the other nodes"
      code=1
    else
      say "$name done; stopping the other nodes"
    fi
    break 2
  done
  sleep 1 & wait $!  # polling the supervise loops; a signal interrupts the wait at once
done
(( signalled )) && { say "signal: stopping (trainer first)"; code=$signalled; }
stop_all
exit "$code"

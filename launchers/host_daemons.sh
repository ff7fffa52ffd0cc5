#!/usr/bin/env bash
# Per-host daemons without SLURM (systemd units, tmux panes, or this script).
# Host 0 runs manager + buffer + trainer; every host runs one relay and its rollouts.
#
#   HOST_INDEX=0 HEAD_IP=10.0.0.1 ./launchers/host_daemons.sh configs/gpu_qwen.yaml
#   HOST_INDEX=1 HEAD_IP=10.0.0.1 ./launchers/host_daemons.sh configs/gpu_qwen.yaml
#
# All hosts need the same config, the same keys directory (laminar keys DIR) and
# explicit endpoints for every service (cluster.endpoints) when on tcp.
#
# Supervision, the same policy as `laminar run` (laminar/children.py): a node that dies
# (crash, kill -9, or exiting by itself) is restarted after BACKOFF_S seconds, doubling per
# restart of that node within RESTART_WINDOW_S, capped at BACKOFF_MAX_S; the other nodes keep
# running. More than MAX_RESTARTS deaths of one node within RESTART_WINDOW_S, or one exit
# with code 3 (EXIT_PERMANENT: e.g. nothing to train), stop the host (exit 1, naming the node). The trainer exiting 0 is the job done: the host stops, exit 0.
# SIGTERM/SIGINT stop in order: trainer, rollouts, buffer, relay, manager (each node gets
# STOP_TIMEOUT_S to drain, then SIGKILL); exit 128 + the signal.
# Defaults mirror cluster.restart in the config; override them in the environment.
set -uo pipefail
CONFIG=${1:?usage: host_daemons.sh CONFIG [key=value ...]}; shift
HOST_INDEX=${HOST_INDEX:?set HOST_INDEX}
ROLLOUTS=${ROLLOUTS:-8}
MAX_RESTARTS=${MAX_RESTARTS:-5}
RESTART_WINDOW_S=${RESTART_WINDOW_S:-600}
BACKOFF_S=${BACKOFF_S:-1}
BACKOFF_MAX_S=${BACKOFF_MAX_S:-30}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-15}
LAMINAR=${LAMINAR:-laminar}

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

if [ "$HOST_INDEX" = 0 ]; then
  start manager "$LAMINAR" node --role manager --config "$CONFIG" "$@"
  start buffer "$LAMINAR" node --role buffer --config "$CONFIG" "$@"
fi
start "relay-$HOST_INDEX" "$LAMINAR" node --role relay --index "$HOST_INDEX" --config "$CONFIG" "$@"
start "rollout-$((HOST_INDEX * ROLLOUTS))" "$LAMINAR" node --role rollout \
  --index $((HOST_INDEX * ROLLOUTS)) --count "$ROLLOUTS" \
  --config "$CONFIG" "rollout.relay_index=${HOST_INDEX}" "$@"
if [ "$HOST_INDEX" = 0 ]; then
  start trainer "$LAMINAR" node --role trainer --config "$CONFIG" "$@"
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

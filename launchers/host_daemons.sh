#!/usr/bin/env bash
# Per-host daemons without SLURM (systemd units, tmux panes, or this script).
# Host 0 runs manager + buffer + trainer; every host runs one relay and its rollouts.
#
#   HOST_INDEX=0 HEAD_IP=10.0.0.1 ./launchers/host_daemons.sh configs/gpu_qwen.yaml
#   HOST_INDEX=1 HEAD_IP=10.0.0.1 ./launchers/host_daemons.sh configs/gpu_qwen.yaml
#
# All hosts need the same config, the same keys directory (laminar keys DIR) and
# explicit endpoints for every service (cluster.endpoints) when on tcp.
set -euo pipefail
CONFIG=${1:?usage: host_daemons.sh CONFIG [key=value ...]}; shift
HOST_INDEX=${HOST_INDEX:?set HOST_INDEX}
ROLLOUTS=${ROLLOUTS:-8}
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' INT TERM

if [ "$HOST_INDEX" = 0 ]; then
  laminar node --role manager --config "$CONFIG" "$@" & pids+=($!)
  laminar node --role buffer --config "$CONFIG" "$@" & pids+=($!)
fi
laminar node --role relay --index "$HOST_INDEX" --config "$CONFIG" "$@" & pids+=($!)
laminar node --role rollout --index $((HOST_INDEX * ROLLOUTS)) --count "$ROLLOUTS" \
  --config "$CONFIG" "rollout.relay_index=${HOST_INDEX}" "$@" & pids+=($!)
if [ "$HOST_INDEX" = 0 ]; then
  laminar node --role trainer --config "$CONFIG" "$@" & pids+=($!)
fi
wait -n "${pids[@]}"
echo "host_daemons: a node exited; stopping the others" >&2
kill -TERM "${pids[@]}" 2>/dev/null || true
wait

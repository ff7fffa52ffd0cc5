#!/usr/bin/env bash
# Give one process its GPUs, then run it (used by slurm_laminar.sbatch and host_daemons.sh):
#
#   launchers/on_gpus.sh FIRST COUNT CMD [ARG ...]
#
# CUDA_VISIBLE_DEVICES becomes slots FIRST .. FIRST+COUNT-1 of the GPUs this process may use:
# the list it inherited (SLURM sets one for a step that holds GPUs, numbered physically or
# per cgroup; picking from that list is right either way), else 0 1 2 .... COUNT 0 hides
# every GPU (a CPU rollout or node).
#
# Under srun, PET_NODE_RANK (torchrun's --node_rank) becomes SLURM_NODEID: the job's first
# node is node rank 0 and holds the trainer's rank 0, the only rank on the cluster network.
set -euo pipefail

if (( $# < 3 )); then
  echo "usage: on_gpus.sh FIRST COUNT CMD [ARG ...]" >&2
  exit 2
fi
first=$1 count=$2
shift 2
if [[ ! $first =~ ^[0-9]+$ || ! $count =~ ^[0-9]+$ ]]; then
  echo "on_gpus.sh: FIRST and COUNT must be whole numbers, got '$first' '$count'" >&2
  exit 2
fi

if (( count > 0 )); then
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
  else
    mapfile -t visible < <(seq 0 $((first + count - 1)))
  fi
  if (( first + count > ${#visible[@]} )); then
    echo "on_gpus.sh: GPU slots $first..$((first + count - 1)) asked, but this process sees" \
      "${#visible[@]} GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset})" >&2
    exit 2
  fi
  picked=("${visible[@]:first:count}")
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${picked[*]}")
else
  CUDA_VISIBLE_DEVICES=
fi
export CUDA_VISIBLE_DEVICES
if [[ -n ${SLURM_NODEID:-} ]]; then
  export PET_NODE_RANK=$SLURM_NODEID
fi
exec "$@"

"""The relay tier: per-host shared-memory weight store and the pipelined chain broadcast.

    layout.py  flat buffer layout (names, dtypes incl. bf16, shapes, aligned offsets) + checksums
    shm.py     /dev/shm segments, slot pool, versions, reader pins (double buffering)
    chain.py   downstream half of a relay: choose a live upstream, fetch chunks with a window
    local.py   real relay processes for tests and bench/weights.py

The node that wires them is laminar/relay/node.py; the trainer and rollout ends are
laminar/transport/weights.py (and weights_gpu.py for CUDA IPC / NCCL).
"""

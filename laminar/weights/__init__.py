"""Moving a weight version from the trainer to the rollouts: everything but the wire itself.

    layout.py        one version as a flat buffer: aligned offsets, chunks, crc32s, checksum
    segment.py       the shared-memory segment: the relay's WeightStore (slots, versions,
                     pins), the trainer's WriterMap and a rollout's map_segment
    delta.py         sparse element deltas of a chunk, and the relays' delta mode on top
    relay_client.py  the relay's clients: WeightPusher (trainer -> master relay) and
                     WeightPuller / PulledWeights (rollout <- its host's relay)
    channel.py       the channel a role opens: open_publisher / open_subscriber for the
                     relay, dir and announce modes (ChannelSettings from laminar/wiring/common.py)
    gpu.py           flat device buffers, CUDA IPC export/open, device by UUID, pinned memory
    group.py         the broadcast group (NCCL on GPUs, gloo on CPU): generations over a TCPStore
    leases.py        reader leases: when a shared version's buffer may be freed
    gpu_channel.py   the nccl and cuda_ipc modes of the channel (relays as their fallback)
    digest.py        the weights digest attestation compares (computed on the tensors' device)

Imports go one way: weights/ -> transport/ (the wire) and protocol/relay.py (the messages)
-> laminar/message.py. The relay role (laminar/relay/) holds the chain between relays and
uses layout, segment and delta; the trainer and rollout nodes open the channel. Nothing here
reads the config tree: the wiring layer (laminar/wiring/common.py) hands in RelayLinks and
ChannelSettings.
"""

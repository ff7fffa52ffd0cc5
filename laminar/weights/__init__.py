"""Moving a weight version from the trainer to the rollouts: everything but the wire itself.

    channel.py     the interfaces: WeightPublisher / WeightSubscriber / WeightSink, Published,
                   ChannelSettings, RelayLinks, WeightsMode, WeightsUnavailable (no implementation)
    factory.py     open_publisher / open_subscriber for the mode ChannelSettings names (from
                   laminar/wiring/common.py), and publish_streamed; only the trainer and
                   rollout import it
    relay.py       the relay mode: RelayPublisher / RelaySubscriber over the pusher and puller
    pusher.py      WeightPusher: trainer -> master relay (memcpy into its /dev/shm slot, failover)
    puller.py      WeightPuller / PulledWeights: rollout <- its host's relay (zero-copy views)
    relay_end.py   RelayEnd: what the pusher and the puller both keep (links, wiring)
    dir.py         the dir mode: one safetensors file per version in run_dir/weights
    announce.py    the announce mode: nothing moves (sim engines)
    nccl.py        the nccl mode: the broadcast group first, the relays as its fallback
    group.py       the broadcast group (NCCL on GPUs, gloo on CPU): generations over a TCPStore;
                   GroupSettings (the group and the weights store)
    cuda_ipc.py    the cuda_ipc mode: the trainer's device buffer mapped on its host (export,
                   open by GPU UUID, leases), the relays elsewhere
    gpu.py         flat device buffers (pack_flat, FlatWeights) and pinned host memory
    leases.py      reader leases: when a shared version's buffer may be freed
    layout.py      one version as a flat buffer: aligned offsets, chunks, crc32s, checksum
    segment.py     the shared-memory segment: the relay's WeightStore (slots, versions,
                   pins), the trainer's WriterMap and a rollout's map_segment
    sink.py        VersionSink: a version exported tensor by tensor (DictSink, FlatSink)
    delta.py       sparse element deltas of a chunk, and the relays' delta mode on top
    digest.py      the weights digest attestation compares (computed on the tensors' device)

Imports go one way: factory.py -> the modes (relay, dir, announce, nccl, cuda_ipc) -> pusher /
puller -> channel.py (the interfaces) -> group.py (GroupSettings) -> gpu, layout, ...; and
weights/ -> transport/ (the wire) and protocol/relay.py (the messages) -> laminar/message.py.
The relay role (laminar/relay/) holds the chain between relays and uses layout, segment and
delta; the trainer and rollout nodes open the channel (factory.py). Nothing here reads the
config tree: the wiring layer (laminar/wiring/common.py) hands in RelayLinks and ChannelSettings.
"""

"""The relay role: one daemon per host holding the newest weights in shared memory, one hop of
the pipelined chain broadcast between hosts.

    node.py    RelayNode: wires the parts; serves the trainer's handoff (Stage/Push/Commit),
               the rollouts' Pull/Release; publishes WeightsReady; turns the chain follower's
               events into offers and announcements
    chain.py   one hop of the chain, both halves: ChainFollower (downstream: chooses a live
               upstream, fetches chunks with a window, emits ReceivingStarted /
               VersionComplete on its event queue) and ChunkService (upstream: answers
               FetchChunk from the store, paced per downstream); neither sees the node

The store, layouts, checksums and deltas are laminar/weights/ (segment.py, layout.py,
delta.py). Imports go one way: relay/ -> weights/ -> transport/ -> laminar/message.py.
The trainer and rollout reach relays only through the weights channel
(laminar/weights/channel.py). Test harnesses: tests/relay_procs.py (real relay processes),
tests/inproc_relays.py, tests/relay_faults.py.
"""

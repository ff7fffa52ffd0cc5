"""The relay role: one daemon per host holding the newest weights in shared memory, one hop of
the pipelined chain broadcast between hosts.

    node.py    RelayNode: wires the parts; serves the trainer's handoff (Stage/Push/Commit),
               the rollouts' Pull/Release, chunk fetches from its downstream; publishes
               WeightsReady; turns the chain follower's events into offers and announcements
    shm.py     WeightStore: /dev/shm segments, slot pool, versions, reader pins (double buffering)
    chain.py   ChainFollower: chooses a live upstream, fetches chunks with a window, emits
               ReceivingStarted / VersionComplete on its event queue (never sees the node)
    delta.py   delta mode: chunks travel as sparse element deltas against the previous version
               (the encoding: laminar/transport/weights_delta.py)
    local.py   RelayProcs: real relay processes for tests and bench/weights.py

Imports go one way: relay/ → laminar/transport/ (weight_layout.py for layouts and checksums,
weights.py for the trainer / rollout ends the tests drive) → protocol/. The trainer and
rollout reach relays only through the weights channel (laminar/transport/weights_channel.py).
"""

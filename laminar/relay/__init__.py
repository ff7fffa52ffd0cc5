"""The relay role: one daemon per host holding the newest weights in shared memory, one hop of
the pipelined chain broadcast between hosts.

    node.py    RelayNode: wires the parts; serves the trainer's handoff (Stage/Push/Commit),
               the rollouts' Pull/Release; publishes WeightsReady for the versions the chain
               follower reports complete (its event queue) and the trainer hands off
    view.py    ChainView: the chain as this relay sees it (order, epoch, head, dead relays)
               and the election of a new head; no I/O
    fetch.py   the downstream half of a hop: ChainFollower chooses a live upstream, fetches
               chunks with a window into the store, has a version offered downstream as it
               begins to arrive, emits VersionComplete on its event queue
    serve.py   the upstream half of a hop: ChunkService offers versions to the downstream
               relays and answers their OfferRequest / FetchChunk from the store, paced per
               downstream (Pacer)

A hop's calls go one way: node → fetch → view, serve → the store; no part sees the node.

The store, layouts, checksums and deltas are laminar/weights/ (segment.py, layout.py,
delta.py). Imports go one way: relay/ -> weights/ -> transport/ -> laminar/message.py.
The trainer and rollout reach relays only through the weights channel
(laminar/weights/factory.py opens it). Test harnesses: tests/relay_procs.py (real relay processes),
tests/inproc_relays.py, tests/relay_faults.py.
"""

"""The buffer role: node.py wires these parts and hands each request to one of them.

prompt_server.py  PromptRequest -> retry table, admission, capacity, pool -> journaled PromptReply
intake.py         Trajectory / TrajectoryAbandoned -> journaled Ack (dedup, late members)
batches.py        BatchRequest long-poll -> whole groups -> journaled BatchReply; BatchCommit
partials.py       PartialChunks -> contiguous in-flight prefixes (the partial pool)
holders.py        who holds a sample by the pool: PartialsRequest (recover), HeldRequest (pages)
ledger.py         journal + experience state: append, apply, durability, wake-ups, compaction
experience.py     groups -> batches -> commits, rebuilt from the journal (exactly-once)
journal.py        append-only, checksummed msgpack records; fsync policy; torn-tail recovery
prompts.py        jsonl/parquet rows -> PromptPool (epochs, seeded shuffle, cursor) -> PromptItems
sampling.py       batch sampling orders (fifo | lifo | random | module:function)

Imports go one way: node -> {prompt_server, intake, batches} -> ledger -> experience ->
{journal, sampling}; holders -> {partials, experience}; no part imports the node. The mode rules
(admission, batch planning) are laminar/modes.py, shared with the simulator.
"""

"""The buffer role's parts (the node itself is laminar/buffer/node.py).

prompts.py     jsonl/parquet rows -> PromptPool (epochs, seeded shuffle, cursor) -> PromptItems
partials.py    PartialChunks -> contiguous in-flight prefixes (recovery of dead rollouts)
journal.py     append-only, checksummed msgpack records; fsync policy; torn-tail recovery
experience.py  groups -> batches -> commits, rebuilt from the journal (exactly-once)
admission.py   modes and staleness bounds as pure rules (shared with the simulator)
sampling.py    batch sampling orders (fifo | lifo | random | module:function)
"""

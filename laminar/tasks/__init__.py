"""Synthetic, verifiable tasks that Laminar can train on without any dataset hub.

    countup  "37+8>60?" -> "37+8=45;45+8=53;53+8=61;#61": a step chain of long-tailed
             length, learnable by a tiny character-level model on CPU (the default demo)

Each task module offers `generate` (rows in memory), `write_splits` (train.jsonl /
eval.jsonl), `solve`, `demonstration` (imperfect solutions for a warm-up),
`verify`, and `reward(prompt, completion, **row)`; and a CLI:

    python -m laminar.tasks.countup --out data/countup --train 20000 --eval 500 --seed 0
"""

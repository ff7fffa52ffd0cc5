"""The manager role: node.py (membership, repack rounds, recovery, relay chain order) and its
pure policies, repack.py (the best-fit planner) and staleness.py (the modes' admission rules),
which the buffer and bench/simulate.py import from those modules directly."""

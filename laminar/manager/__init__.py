"""The manager role: node.py (membership, repack rounds, recovery, relay chain order) and its
pure policy repack.py (the best-fit planner), which bench/simulate.py imports directly. The
modes' rules live in laminar/modes.py (the buffer and the simulator use them too)."""

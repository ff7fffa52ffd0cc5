"""The rollout role: node.py wires the parts (versions.py, sequences.py, feeder.py, deliver.py,
outbox.py, tracking.py); weights arrive through laminar.weights.channel."""

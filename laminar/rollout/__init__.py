"""Rollout-side helpers: acked outbox, weight sources, per-trajectory tracking (the node is laminar/rollout/node.py)."""

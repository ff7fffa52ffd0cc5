"""Rollout engines behind one interface (base.py): torch, vllm, sim; factory.py picks the one
rollout.engine names and imports it lazily."""

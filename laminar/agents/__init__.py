"""Black-box agents: chat rendering for the OpenAI-compatible endpoint, and the worker process
that runs a user's `agent.fn` (the driver is laminar/rollout/agents.py)."""

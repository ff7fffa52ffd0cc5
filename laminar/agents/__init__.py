"""Black-box agents: chat rendering for the OpenAI-compatible endpoint, and the worker process
that runs a user's `agent.fn` (the driver is laminar/rollout/agents.py)."""

MOVED_TO = "Laminar-Moved-To"
"""Response header of a 421 episode_moved (laminar/rollout/agents.py): the node id of the rollout
the episode was exported to, whose endpoint is run_dir/agents/endpoints/<node id> (a hint: the
manager may place it elsewhere); absent when not known. The client's transport
(laminar/agents/failover.py) asks there first."""

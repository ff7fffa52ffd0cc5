"""Tools for multi-turn episodes: a registry of Python callables, run in a sandboxed worker pool.

registry.py   Tool + Registry: built-ins (builtin.py) and `module:function` entries, argument checks
builtin.py    the `python` REPL tool and the `calculator`
sandbox.py    SandboxPool: worker processes (fresh netns, fork per call, rlimits, wall-clock kill)
cache.py      ToolCache: each call id runs at most once; results journaled under run_dir/tools/
client.py     LocalToolClient: the tools in process (a rollout's client: rollout/tool_client.py)
node.py       ToolsNode: the "tools" role serving ToolCallRequest / ToolStatsRequest
"""

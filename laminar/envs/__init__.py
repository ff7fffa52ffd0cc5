"""Multi-turn environments: the model writes, the environment answers, until done.

    base.py       the protocol: Environment (reset / step / score), StepContext, StepResult,
                  ToolClient
    loader.py     load_env(cfg.env): env.fn as module:Class or module:function
    tool_env.py   ToolEnv: <tool_call>{json}</tool_call> turns answered by the tools node
    toolcall.py   the tool-call parser and the tool-response format
    template.py   TurnTemplate: the exact observation tokens (chat template diff, or a plain format)
    replay.py     split_segments + replay: rebuild an episode's state on another rollout
    adapters/     reasoning-gym as a dataset + reward source; notes on verifiers

Design (fixed for issue 12): every model token of an episode comes from one weight
version; environment state survives a rollout's loss by deterministic replay of the
recorded turns with tool calls answered from the tools node's cache; token in, token out
(the observation is tokenized once by the turn template, nothing is re-tokenized).
Tests: .venv/bin/python -m pytest -q tests/test_envs.py
"""

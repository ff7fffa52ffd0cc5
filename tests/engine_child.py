"""Processes for tests/test_engine_start.py: a rollout-like process, its engine, the engine's
worker.

    python tests/engine_child.py rollout node|bare  # prints "PIDS <engine pid> <worker pid>", runs
    python tests/engine_child.py engine             # (started by the rollout) prints the same line
    python tests/engine_child.py worker             # (started by the engine) prints "PIDS <pid>"

The shape of vLLM on CPU: rollout -> EngineCore -> worker. The engine imports
laminar.engines.vllm_ext, whose import-time hook ties it to the rollout (LAMINAR_ENGINE_PARENT);
the worker runs the vLLM plugin hook, and like vLLM's workers also dies with its engine.
`rollout node` is a Node (SIGTERM stops it and its closers close the engine); `rollout bare`
is a process with no handler at all (SIGTERM kills it outright, like kill -9).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading


def _start(mode: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, mode], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("PIDS "), f"{mode} said {line!r}"
    return proc, line.removeprefix("PIDS ").strip()


def engine() -> None:
    import laminar.engines.vllm_ext  # noqa: F401  (its import runs die_with_parent)

    _, worker_pid = _start("worker")
    print("PIDS", os.getpid(), worker_pid, flush=True)
    threading.Event().wait()


def worker() -> None:
    from laminar.engines.lifeline import die_with_parent, vllm_plugin

    vllm_plugin()  # dies with the rollout ...
    die_with_parent(os.getppid())  # ... and with its engine (vLLM's death pipe)
    print("PIDS", os.getpid(), flush=True)
    threading.Event().wait()


def rollout(how: str) -> None:
    from laminar.engines.lifeline import lifeline_env

    env = {**os.environ, **lifeline_env()}
    if how == "bare":
        _, pids = _start("engine", env)
        print("PIDS", pids, flush=True)
        threading.Event().wait()
        return

    from laminar.config import LaminarConfig
    from laminar.node import Node, run_nodes
    from laminar.wiring.common import node_settings

    class EngineHost(Node):
        role = "rollout"
        registers_with_manager = False

        async def setup(self) -> None:
            proc, pids = await asyncio.to_thread(_start, "engine", env)

            async def close() -> None:
                proc.terminate()
                await asyncio.to_thread(proc.wait, 10)

            self.on_close(close)
            print("PIDS", pids, flush=True)

    asyncio.run(run_nodes([EngineHost(node_settings(LaminarConfig(), "rollout"))]))


if __name__ == "__main__":
    {"engine": engine, "worker": worker}.get(sys.argv[1], lambda: rollout(sys.argv[2]))()

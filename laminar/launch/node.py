"""`laminar node`: run one node (or `--count` of them sharing one zmq context) in this process.

    python -m laminar node --role rollout --index 0 --count 2 --config run_dir/config.yaml

Outside `laminar run` (no LAMINAR_PARENT_PID) it first checks the role's inputs
(laminar/preflight.py). A child of `laminar run` stops when its launcher vanished. Exit 0 when
the nodes stopped cleanly, EXIT_PERMANENT for a failure a restart would repeat, else EXIT_FAILED.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TYPE_CHECKING

from laminar.config import Role, load_config
from laminar.launch.ipc_dir import prepare_ipc_dir
from laminar.launch.tuning import (
    heavy_imports,
    lower_priority,
    prefetch_imports,
    setup_process,
    use_uvloop,
)

if TYPE_CHECKING:  # the node runtime (zmq) loads inside node_main
    from laminar.node import Node


async def _watch_parent(nodes: list[Node], parent: int) -> None:
    # a child of `laminar run` stops if its launcher vanished (e.g. kill -9)
    while True:
        await asyncio.sleep(1.0)  # a timer
        if os.getppid() != parent:
            for n in nodes:
                n.request_stop("launcher died")
            return


def node_main(
    role: Role, config: str | None, overrides: list[str], index: int = 0, count: int = 1
) -> int:
    cfg = load_config(config, overrides)
    if "LAMINAR_PARENT_PID" not in os.environ:  # `laminar run` checked every role already
        from laminar.preflight import check_inputs

        check_inputs(cfg, [role])
    setup_process(cfg)
    prepare_ipc_dir(cfg)
    from laminar.node import NodeFailed, run_nodes
    from laminar.supervise import (
        EXIT_FAILED,
        EXIT_PERMANENT,
        PermanentFailure,
        detached_spawn,
    )
    from laminar.transport.sockets import new_context
    from laminar.wiring.nodes import build_node, role_modules

    role_modules(role)
    # after the node's own light imports (numpy, zmq): the thread only ever waits on torch's
    prefetch_imports(heavy_imports(cfg, role))

    async def amain() -> None:
        # several nodes in one process (emulated scale) share one zmq context: one I/O thread, not N
        ctx = new_context() if count > 1 else None
        nodes = [build_node(cfg, role, i, ctx=ctx) for i in range(index, index + count)]
        parent = os.environ.get("LAMINAR_PARENT_PID")
        watcher = (
            detached_spawn(_watch_parent(nodes, int(parent)), "watch-parent") if parent else None
        )

        async def yield_once_ready() -> None:
            # not before: every role's start is on the way to the first step (the trainer waits for
            # the rollouts' first batch), and a rollout that yields while starting only delays it
            await asyncio.gather(*(n.ready.wait() for n in nodes))
            lower_priority(cfg, role)

        renice = detached_spawn(yield_once_ready(), "nice") if cfg.cluster.nice.get(role) else None
        try:
            await run_nodes(nodes)
        finally:
            for task in (watcher, renice):
                if task:
                    task.cancel()
            if ctx is not None:
                ctx.destroy(linger=0)

    use_uvloop()
    try:
        asyncio.run(amain())
    except NodeFailed as exc:
        print(f"laminar node {role}-{index}: FAILED: {exc} ({exc.__cause__!r})", file=sys.stderr)
        return EXIT_PERMANENT if isinstance(exc.__cause__, PermanentFailure) else EXIT_FAILED
    return 0

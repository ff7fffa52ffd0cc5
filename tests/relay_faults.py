"""Fault injection for the relay tests: chunks a relay corrupts the first time it sends them.

    corrupt_chunks(relay_node, [1, 3])          # in process (tests/inproc_relays.py)
    python tests/relay_faults.py 1,3 node --role relay --index 0 --config C   # a relay process

Each chosen chunk of each version goes out once with one byte flipped, counted in the
relay's `chunks_corrupted_on_purpose`; the downstream must catch it on the master's crc32
and fetch it again. The product has no hook for this: the test wraps the relay's
ChunkService.fetch (laminar/relay/serve.py) from outside.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from laminar.metrics import Metrics
from laminar.protocol.relay import FetchChunk, WeightChunk
from laminar.relay.node import RelayNode

Fetch = Callable[[Any, FetchChunk], Awaitable[Any]]


def corrupting(fetch: Fetch, indices: Iterable[int], metrics: Metrics) -> Fetch:
    """`fetch` with chunks `indices` of every version corrupted the first time they go out."""
    chosen, done = set(indices), set()

    async def wrapped(peer: Any, msg: FetchChunk) -> Any:
        reply = await fetch(peer, msg)
        key = (msg.version, msg.index)
        if isinstance(reply, WeightChunk) and msg.index in chosen and key not in done:
            done.add(key)
            data = reply.data.copy()
            data[len(data) // 2] ^= 0xFF
            reply.data = data
            metrics.count("chunks_corrupted_on_purpose")
        return reply

    return wrapped


def corrupt_chunks(node: RelayNode, indices: Iterable[int]) -> None:
    """Make a started relay node corrupt `indices` (replaces its FetchChunk handler)."""
    node.data.on(FetchChunk, corrupting(node.chunks.fetch, indices, node.metrics))


def main(argv: list[str]) -> int:
    """`relay_faults.py INDICES laminar-cli-args...`: a relay process that corrupts INDICES."""
    indices = [int(i) for i in argv[0].split(",") if i]
    setup = RelayNode.setup

    async def corrupting_setup(self: RelayNode) -> None:
        await setup(self)
        corrupt_chunks(self, indices)

    RelayNode.setup = corrupting_setup  # type: ignore[method-assign]
    from laminar.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

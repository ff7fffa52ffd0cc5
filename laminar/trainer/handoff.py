"""How a new policy version leaves the trainer: one small interface, three ways.

    handoff = make_handoff(node)             # picks one from the config (below)
    await handoff.start()
    res = await handoff.publish(version, step, named_tensors)   # -> Published(uri, bytes, stall_s)

  relay   laminar.transport.weights.WeightPusher to the master relay (the relay tier):
          used when that module is importable and cluster.roles.relay > 0.
  direct  no relay tier: run_dir/weights/v{version}.safetensors, written to a temp
          name and renamed (a reader never sees half a file); the last `keep`
          versions stay. Tests and single-host runs without relays use it.
  sim     the sim trainer without relays: nothing to move, only the version.

The trainer then announces the version (VersionPublished) to the manager.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Published:
    handoff: str
    uri: str = ""
    num_bytes: int = 0
    stall_s: float = 0.0


class DirectHandoff:
    kind = "direct"

    def __init__(self, node: Any, keep: int = 4):
        self.node = node
        self.dir = Path(node.cfg.resolved_run_dir()) / "weights"
        self.keep = keep

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, version: int, tensors: dict[str, Any]) -> tuple[str, int]:
        from safetensors.torch import save_file

        final = self.dir / f"v{version}.safetensors"
        tmp = self.dir / f".v{version}.safetensors.tmp"
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(cpu, str(tmp), metadata={"version": str(version)})
        os.replace(tmp, final)
        for old in sorted(self.dir.glob("v*.safetensors"), key=lambda p: int(p.stem[1:]))[
            : -self.keep
        ]:
            old.unlink(missing_ok=True)
        return str(final), sum(v.numel() * v.element_size() for v in cpu.values())

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        t0 = time.perf_counter()
        uri, n = await self.node.compute(self._write, version, tensors or {})
        return Published(self.kind, uri, n, time.perf_counter() - t0)

    async def close(self) -> None:
        pass


class RelayHandoff:
    kind = "relay"

    def __init__(self, node: Any):
        from laminar.transport.weights import WeightPusher

        self.pusher = WeightPusher(node)

    async def start(self) -> None:
        await self.pusher.start()

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        t0 = time.perf_counter()
        stall = await self.pusher.push(version, tensors or {})
        n = sum(v.numel() * v.element_size() for v in (tensors or {}).values())
        return Published(
            self.kind, "", n, float(stall) if stall is not None else time.perf_counter() - t0
        )

    async def close(self) -> None:
        close = getattr(self.pusher, "close", None)
        if close is not None:
            res = close()
            if hasattr(res, "__await__"):
                await res


class SimHandoff:
    kind = "sim"

    def __init__(self, node: Any):
        self.node = node

    async def start(self) -> None:
        pass

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        return Published(self.kind)

    async def close(self) -> None:
        pass


def relay_available(cfg: Any) -> bool:
    return (
        cfg.cluster.roles.get("relay", 0) > 0
        and importlib.util.find_spec("laminar.transport.weights") is not None
    )


def make_handoff(node: Any):
    """The one line that decides how weights leave the trainer."""
    cfg = node.cfg
    if relay_available(cfg):
        return RelayHandoff(node)
    return SimHandoff(node) if cfg.trainer.engine == "sim" else DirectHandoff(node)

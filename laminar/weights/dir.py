"""The dir mode of the weights channel: one safetensors file per version in a directory.

    pub = DirPublisher(run_dir / "weights")   # trainer: v{version}.safetensors, keeps the last 4
    sub = DirSubscriber(run_dir / "weights")  # rollout: loads the newest complete file

The trainer writes each version under a temporary name and renames it (a reader never sees
half a file); a rollout polls the directory (it has no change notification) at most every
`poll_s`, and a file pruned while it reads is a WeightsUnavailable (the caller retries).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from laminar.weights.channel import Published, WeightSink, WeightSubscriber, WeightsUnavailable
from laminar.weights.layout import tensors_nbytes

_FILE = re.compile(r"^v(\d+)\.safetensors$")


class DirPublisher:
    kind = "direct"

    def __init__(self, directory: str | os.PathLike[str], keep: int = 4):
        self.dir = Path(directory)
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
        versions = sorted(self.dir.glob("v*.safetensors"), key=lambda p: int(p.stem[1:]))
        for old in versions[: -self.keep]:
            old.unlink(missing_ok=True)
        return str(final), tensors_nbytes(cpu)

    async def publish(self, version: int, step: int, tensors: dict[str, Any] | None) -> Published:
        t0 = time.perf_counter()
        uri, n = await asyncio.to_thread(self._write, version, tensors or {})
        return Published(self.kind, uri, n, time.perf_counter() - t0)

    async def close(self) -> None:
        pass


class DirSubscriber(WeightSubscriber):
    name = "dir"

    def __init__(self, directory: str | os.PathLike[str], poll_s: float = 0.25):
        self.dir = Path(directory)
        self.poll_s = poll_s
        self._latest = -1
        self._scanned_at = 0.0

    def _scan(self) -> tuple[int, Path | None]:
        best, path = -1, None
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return -1, None
        for e in entries:
            m = _FILE.match(e.name)
            if m and int(m.group(1)) > best:
                best, path = int(m.group(1)), Path(e.path)
        return best, path

    def latest_version(self) -> int:
        now = time.monotonic()
        # heartbeats ask often; the disk is asked at most every poll_s
        if now - self._scanned_at >= self.poll_s:
            self._latest = self._scan()[0]
            self._scanned_at = now
        return self._latest

    async def wait_newer(self, than: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            v = self.latest_version()
            if v > than or time.monotonic() >= deadline:
                return v
            # a directory has no change notification: poll it
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    async def load_into(self, engine: WeightSink) -> int:
        version, path = self._scan()
        if path is None:
            raise WeightsUnavailable(f"no weights in {self.dir}")
        try:
            tensors = await asyncio.to_thread(_read_safetensors, path)
        except Exception as exc:  # vanished (pruned by the trainer) or unreadable: try again later
            raise WeightsUnavailable(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
        await engine.load_weights(tensors.items(), version)
        self._latest = max(self._latest, version)
        return version


def _read_safetensors(path: Path) -> dict[str, Any]:
    # torch tensors when torch is loaded anyway (torch/vllm engines; keeps bf16); numpy otherwise,
    # so a sim rollout never pays for importing torch
    if "torch" in sys.modules:
        from safetensors.torch import load_file as load_torch

        return load_torch(str(path))
    from safetensors.numpy import load_file as load_numpy

    return dict(load_numpy(str(path)))

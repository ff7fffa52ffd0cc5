"""Results by call id: each call id executes at most once, across retries, replays and restarts.

    cache = ToolCache(run_dir / "tools" / "tools-0.journal")    # None: in memory only
    cache.load()                                               # before serving (blocking file read)
    res = await cache.run(call_id, name, side_effects, lambda: pool.run(...))

    first call of an id ──► "start" record (side-effecting tools only, fsync'ed) ──► run ──►
        "done" record (fsync'ed) ──► result stored ──► reply
    the same id while it runs ──► awaits the first run's future ──► its result, cached=True
    the same id later ────────► the stored result, cached=True (nothing runs)

Call ids are deterministic (`uid#tTURN#cK`, laminar.envs.base.call_id), so a retried request,
and an episode replayed on another rollout after its first rollout died, ask for the same id
and get the first run's answer. A result that says the tool crashed or timed out is stored
too: the call ran. Refusals that ran nothing (busy, bad_call, unknown_tool, unavailable) are
not stored, so a later attempt may run.

Journal: one JSON object per line, appended and fsync'ed per record before the reply (a tool
call costs milliseconds or more; the fsync is done off the event loop). On load, a "start"
without its "done" is a side-effecting call that was running when the tools node stopped: it
is answered with error_kind interrupted and never run again. Pure tools journal only "done",
so one interrupted by a crash simply runs again.

Memory: the last `max_entries` results are kept whole; for every id only its journal offset is
kept besides (tens of bytes), and a repeat of an older id reads its record back from the file.
Without a journal, ids older than the last `max_entries` are forgotten (and could run again). The
journal is never compacted: one line per call (~1 KB with output) is small next to a run's
trajectory journal.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from laminar.envs.base import ToolResult

NOT_STORED = frozenset({"busy", "bad_call", "unknown_tool", "unavailable"})
"""error kinds of calls that never ran: a later attempt of the id may run."""


class ToolCache:
    def __init__(self, path: Path | None = None, max_entries: int = 50_000):
        self.path, self.max_entries = path, max_entries
        self._results: collections.OrderedDict[str, ToolResult] = collections.OrderedDict()
        self._offsets: dict[str, int] = {}
        """id -> offset of its "done" record in the journal (every id ever run, when journaled)."""
        self._running: dict[str, asyncio.Future[ToolResult]] = {}
        self._file: Any = None
        self._lock = asyncio.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    # ---- journal -----------------------------------------------------------------------
    def load(self) -> int:
        """Read the journal (if any) and open it for appending; returns the number of results."""
        if self.path is None:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        started: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            with open(self.path, "rb+") as f:
                offset = 0
                for line in f:
                    here, offset = offset, offset + len(line)
                    if not line.endswith(b"\n"):  # a record torn by a crash: cut it off
                        self.counts["journal_bad_lines"] += 1
                        f.truncate(here)
                        break
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        self.counts["journal_bad_lines"] += 1
                        continue
                    if rec.get("t") == "start":
                        started[rec["id"]] = rec
                    elif rec.get("t") == "void":
                        started.pop(rec["id"], None)
                    elif rec.get("t") == "done":
                        started.pop(rec["id"], None)
                        self._remember(_result(rec), here)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        for cid, rec in started.items():  # ran (or was running) when the node stopped: never again
            res = ToolResult(
                cid,
                rec.get("name", ""),
                False,
                error_kind="interrupted",
                error="the tools node stopped while this call ran; it is not run twice",
            )
            self._remember(res, self._append_sync(_done_record(res)))
            self.counts["interrupted"] += 1
        return max(len(self._results), len(self._offsets))

    def _append_sync(self, rec: dict[str, Any]) -> int:
        data = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        offset = self._file.tell()
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        return int(offset)

    async def _append(self, rec: dict[str, Any]) -> int:
        if self._file is None:
            return -1
        async with self._lock:  # one writer at a time: offsets stay exact
            return await asyncio.to_thread(self._append_sync, rec)

    def _read_at(self, offset: int) -> ToolResult:
        assert self.path is not None
        with open(self.path, "rb") as f:
            f.seek(offset)
            return _result(json.loads(f.readline()))

    def _remember(self, res: ToolResult, offset: int) -> None:
        self._results[res.call_id] = res
        self._results.move_to_end(res.call_id)
        if len(self._results) > self.max_entries:
            self._results.popitem(last=False)  # its journal offset stays: a repeat reads it back
        if offset >= 0:
            self._offsets[res.call_id] = offset

    # ---- the one entry point -------------------------------------------------------------
    def lookup(self, call_id: str) -> ToolResult | None:
        """The stored result of an id (marked cached), or None."""
        res = self._results.get(call_id)
        if res is None and call_id in self._offsets:
            res = self._read_at(self._offsets[call_id])
        return None if res is None else replace(res, cached=True)

    async def run(
        self,
        call_id: str,
        name: str,
        side_effects: bool,
        execute: Callable[[], Awaitable[ToolResult]],
    ) -> ToolResult:
        """The result of `call_id`: executed now if it never ran, else the first run's."""
        done = self.lookup(call_id)
        if done is not None:
            self.counts["hits"] += 1
            if done.name != name:
                self.counts["id_conflicts"] += 1
            return done
        running = self._running.get(call_id)
        if running is not None:
            self.counts["joined"] += 1
            return replace(await asyncio.shield(running), cached=True)
        fut: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        self._running[call_id] = fut
        try:
            if side_effects:
                await self._append({"t": "start", "id": call_id, "name": name})
            res = await execute()
            if res.error_kind not in NOT_STORED:
                offset = await self._append(_done_record(res))
                self._remember(res, offset)
                self.counts["executed"] += 1
            elif side_effects:  # it never ran: the start record no longer counts
                await self._append({"t": "void", "id": call_id})
            fut.set_result(res)
            return res
        except BaseException:
            # abandoned mid-run (the node is stopping): a side-effecting call may have acted, so it
            # is recorded as interrupted and never run again; a pure one may run on a later attempt
            res = ToolResult(
                call_id,
                name,
                False,
                error_kind="interrupted",
                error="the first run of this call was abandoned",
            )
            if side_effects:
                offset = self._append_sync(_done_record(res)) if self._file else -1
                self._remember(res, offset)
            else:
                res.error_kind = "unavailable"
            fut.set_result(res)
            raise
        finally:
            self._running.pop(call_id, None)

    def stats(self) -> dict[str, Any]:
        return {
            "cache_entries": max(len(self._results), len(self._offsets)),
            "cache_running": len(self._running),
            **{f"cache_{k}": v for k, v in self.counts.items()},
        }

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _done_record(res: ToolResult) -> dict[str, Any]:
    rec: dict[str, Any] = {"t": "done", "id": res.call_id, **asdict(res)}
    del rec["call_id"]
    return rec


def _result(rec: dict[str, Any]) -> ToolResult:
    fields = {k: rec[k] for k in ToolResult.__dataclass_fields__ if k in rec}
    return ToolResult(**{**fields, "call_id": rec["id"], "cached": False})

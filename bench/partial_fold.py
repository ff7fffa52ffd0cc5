"""The partial pool's fold of one PartialBatch, in process: PartialPool.apply_batch next to a
vectorized prototype of its hot path (issue 51).

    .venv/bin/python bench/partial_fold.py --out bench/results/partial_fold.json   # ~45 s

Shape: bench/control_plane.py's chunk phase (256 rollouts x 65 in-flight records, one 65-entry
batch per rollout per flush window, 32 tokens an entry, every entry continuing its record), each
batch encoded and decoded by the codec first, as the buffer receives it (fresh uid strings), and
folded as from its authenticated sender (vocabulary and length checks on), for --windows windows
(64: records grow to 2,048 tokens). Two workloads: plain entries, and entries with a loss mask
(multi-turn, the 1024-GPU row the control-plane bench is sized by). The figure is the mean over
every batch (a stream's merges included); the median batch is beside it.

apply_batch folds on the sender's stream since issue 51's seventh session (a record's slot is
checked per entry, the window's columns kept once: laminar/buffer/partials.py); before, every
entry's tokens were copied into its record. The prototype keeps the fold's per-record numbers in
numpy arrays of the sender's slot table and checks every entry at once; it is the hot path alone
(no fallback, recovery or compaction), kept as the vectorized floor to compare with.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchinfo import git_state  # noqa: E402

from laminar.buffer.owners import ids_out_of_range  # noqa: E402
from laminar.buffer.partials import PartialPool  # noqa: E402
from laminar.protocol.data import PartialBatch, PartialTrajectory  # noqa: E402
from laminar.transport.codec import decode, encode  # noqa: E402

ROLLOUTS, RECORDS, TOKENS = 256, 65, 32
VOCAB, LONGEST = 32_000, 16_384


def _uids(r: int) -> list[str]:
    return [f"g{r}-{j // 16}/{j % 16}" for j in range(RECORDS)]


def _header(uid: str, rid: str) -> PartialTrajectory:
    gid, _, i = uid.rpartition("/")
    return PartialTrajectory(
        uid=uid,
        group_id=gid,
        prompt_uid="p",
        sample_index=int(i),
        prompt_ids=np.arange(100, dtype=np.int32),
        response_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        version=0,
        n=16,
        rollout_id=rid,
    )


class Workload:
    def __init__(self, masked: bool, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n = RECORDS * TOKENS
        self.ids = rng.integers(0, VOCAB, n).astype(np.int32)
        self.lps = rng.random(n).astype(np.float32)
        self.mask = (rng.random(n) < 0.9).astype(np.uint8) if masked else None
        self.uids = {r: _uids(r) for r in range(ROLLOUTS)}

    def batch(self, r: int, step: int) -> PartialBatch:
        """Rollout r's window `step` (offset step x TOKENS for every record), off the wire."""
        k = RECORDS
        b = PartialBatch(
            rollout_id=f"rollout-{r}",
            uids=list(self.uids[r]),
            versions=np.zeros(k, np.int64),
            offsets=np.full(k, step * TOKENS, np.int64),
            lengths=np.full(k, TOKENS, np.int64),
            token_ids=self.ids,
            logprobs=self.lps,
            awaiting_env=np.zeros(k, np.uint8),
            loss_mask=self.mask,
        )
        return decode([f if isinstance(f, bytes) else bytes(f) for f in encode(b)])


class ColumnarSender:
    """One sender's records as slots (the prototype): arrays by slot, logs by entry."""

    def __init__(self, uids: list[str], groups: list[str], cap: int = 256) -> None:
        self.slot_of = {u: i for i, u in enumerate(uids)}
        self.group_names = sorted(set(groups))
        gi = {g: i for i, g in enumerate(self.group_names)}
        self.group = np.zeros(cap, np.int64)
        self.group[: len(uids)] = [gi[g] for g in groups]
        self.lengths = np.zeros(cap, np.int64)
        self.versions = np.zeros(cap, np.int64)
        self.awaiting = np.zeros(cap, np.uint8)
        self.ids, self.lps, self.mask = bytearray(), bytearray(), bytearray()
        self.e_slot = np.zeros(1 << 12, np.int64)
        self.e_pos = np.zeros(1 << 12, np.int64)
        self.e_len = np.zeros(1 << 12, np.int64)
        self.entries = 0

    def fold(self, b: PartialBatch) -> list[str] | None:
        """The groups the batch progressed, or None: the batch needs the per-entry path."""
        k = len(b.uids)
        if ids_out_of_range(b.token_ids, VOCAB):
            return None
        get = self.slot_of.get
        slots = np.array([get(u, -1) for u in b.uids], np.int64)
        offs, lens = b.offsets, b.lengths
        if k == 0 or int(slots.min()) < 0 or len(np.unique(slots)) != k:
            return None
        ends = offs + lens
        if not (
            (self.lengths[slots] == offs).all()
            and (self.versions[slots] == b.versions).all()
            and int(lens.min()) > 0
            and int(ends.max()) <= LONGEST
        ):
            return None
        self.lengths[slots] = ends
        self.awaiting[slots] = b.awaiting_env
        base = len(self.ids) // 4
        self.ids += memoryview(b.token_ids).cast("B")
        self.lps += memoryview(b.logprobs).cast("B")
        if b.loss_mask is not None:
            self.mask += memoryview(b.loss_mask).cast("B")
        e = self.entries
        if e + k > len(self.e_slot):
            grow = max(len(self.e_slot), k)
            self.e_slot, self.e_pos, self.e_len = (
                np.concatenate([a, np.zeros(grow, np.int64)])
                for a in (self.e_slot, self.e_pos, self.e_len)
            )
        self.e_slot[e : e + k] = slots
        self.e_pos[e : e + k] = base + np.cumsum(lens) - lens
        self.e_len[e : e + k] = lens
        self.entries = e + k
        names = self.group_names
        return [names[g] for g in np.unique(self.group[slots]).tolist()]


def _today(w: Workload) -> tuple[PartialPool, Any]:
    pool = PartialPool(vocab=VOCAB, max_response_tokens=LONGEST, max_entries=4096)
    for r in range(ROLLOUTS):
        rid = f"rollout-{r}"
        for u in w.uids[r]:
            pool._restart(_header(u, rid), rid, rid)
    return pool, lambda r, b: pool.apply_batch(b, f"rollout-{r}")


def _prototype(w: Workload) -> tuple[list[ColumnarSender], Any]:
    senders = [
        ColumnarSender(w.uids[r], [u.rpartition("/")[0] for u in w.uids[r]])
        for r in range(ROLLOUTS)
    ]
    return senders, lambda r, b: senders[r].fold(b)


def measure(fold: Any, w: Workload, windows: int) -> list[float]:
    """Seconds per batch, windows x ROLLOUTS batches (decoding not counted)."""
    out = []
    for step in range(windows):
        batches = [w.batch(r, step) for r in range(ROLLOUTS)]
        for r, b in enumerate(batches):
            t0 = time.perf_counter()
            fold(r, b)
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--windows", type=int, default=64, help="flush windows per rollout per pass (records grow)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="passes per (workload, fold)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/partial_fold.json"))
    args = ap.parse_args(argv)
    rows: dict[str, dict[str, Any]] = {}
    for masked in (False, True):
        name = "masked" if masked else "plain"
        per: dict[str, list[float]] = {"today": [], "prototype": []}
        med: dict[str, list[float]] = {"today": [], "prototype": []}
        for rep in range(args.repeats):
            w = Workload(masked, seed=rep)
            pool, today = _today(w)
            senders, proto = _prototype(w)
            # the same batches through both, in alternating order between repeats
            order = [("today", today), ("prototype", proto)]
            for key, fold in order if rep % 2 == 0 else order[::-1]:
                times = measure(fold, w, args.windows)
                per[key].append(statistics.fmean(times) * 1e6)  # every batch: merges included
                med[key].append(statistics.median(times) * 1e6)
            want = args.windows * TOKENS
            assert pool.tokens == want * len(pool.records) == want * ROLLOUTS * RECORDS, "today's"
            assert all((s.lengths[:RECORDS] == want).all() for s in senders), "prototype's fold"
        rows[name] = {
            "us_per_batch_today": {"runs": per["today"], "median": statistics.median(per["today"])},
            "us_per_batch_prototype": {
                "runs": per["prototype"],
                "median": statistics.median(per["prototype"]),
            },
            "today_over_prototype": statistics.median(per["today"])
            / statistics.median(per["prototype"]),
            "us_per_entry_today": statistics.median(per["today"]) / RECORDS,
            "median_batch_us": {k: statistics.median(v) for k, v in med.items()},
        }
    print(f"\n{'workload':>8} {'today us/batch':>15} {'prototype':>10} {'ratio':>6}")
    for name, row in rows.items():
        print(
            f"{name:>8} {row['us_per_batch_today']['median']:>15.1f} "
            f"{row['us_per_batch_prototype']['median']:>10.1f} {row['today_over_prototype']:>5.2f}x"
        )
    doc = {
        "bench": "partial_fold",
        "config": {
            "rollouts": ROLLOUTS,
            "records_per_rollout": RECORDS,
            "tokens_per_entry": TOKENS,
            "windows": args.windows,
            "repeats": args.repeats,
        },
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        **git_state(),
        "results": rows,
        "summary": {
            f"today_over_prototype_{k}": v["today_over_prototype"] for k, v in rows.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

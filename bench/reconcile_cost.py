"""What a reconciliation round costs (laminar/manager/reconcile.py), in process, at a load.

    .venv/bin/python bench/reconcile_cost.py --out bench/results/reconcile_cost.json   # seconds

The buffer answers a round's HeldRequests (one pass over its partial records per round, served
in pages of HELD_REPLY_BYTES / UID_BYTES uids: HeldPages) and the manager judges the answer
against every rollout's status (`judge`). Both are measured as
CPU time over `--rollouts` x `--inflight` records (default: the control-plane bench's 1x, 256
synthetic rollouts with ~133 samples each), median of `--repeats` rounds, and as core-s/s at the
default period (manager.reconcile_interval_s). The control-plane bench runs with the
reconciliation off (its synthetic statuses name made-up samples), so this is its cost there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from laminar.buffer.holders import HeldPages
from laminar.buffer.partials import PartialPool
from laminar.config import ManagerConfig
from laminar.manager.reconcile import HELD_REPLY_BYTES, UID_BYTES, judge
from laminar.protocol.rollout import RolloutStatus


def measure(rollouts: int, inflight: int, repeats: int) -> dict[str, float | int]:
    pool = PartialPool()
    for r in range(rollouts):
        for k in range(inflight):
            # only the header's rollout id is read (records as the fold keeps them are bigger)
            uid = f"p-{r:04x}{k:012x}@0#{k}/{k % 4}"
            pool.records[uid] = SimpleNamespace(  # type: ignore[assignment]
                header=SimpleNamespace(rollout_id=f"rollout-{r}")
            )
    placed = {u: "rollout-1" for u in list(pool.records)[: rollouts * inflight // 50]}
    ids = [f"rollout-{r}" for r in range(rollouts)]
    max_uids = HELD_REPLY_BYTES // UID_BYTES
    buffer_s, held, pages = [], {}, 0
    for k in range(repeats):
        t0 = time.process_time()
        held, answer, more, pages = {}, HeldPages(), True, 0
        while more:
            page, more = answer.page(pool, placed, ids, k, max_uids)
            held.update(page)
            pages += 1
        buffer_s.append(time.process_time() - t0)
    statuses = {
        rid: RolloutStatus(
            traj_tokens=dict.fromkeys(uids, 1),
            kv_capacity_tokens=1,
            measured_at=1.0,
            target_version=0,
        )
        for rid, uids in held.items()
    }
    manager_s = []
    for _ in range(repeats):
        t0 = time.process_time()
        judge(held, statuses, {}, set())
        manager_s.append(time.process_time() - t0)
    period = ManagerConfig().reconcile_interval_s
    b, m = statistics.median(buffer_s), statistics.median(manager_s)
    return {
        "records": len(pool.records),
        "uids_per_page": max_uids,
        "pages_per_round": pages,
        "buffer_ms_per_round": round(b * 1e3, 2),
        "manager_judge_ms_per_round": round(m * 1e3, 2),
        "period_s": period,
        "buffer_core_s_per_s": round(b / period, 5),
        "manager_core_s_per_s": round(m / period, 5),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=133, help="partial records per rollout")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = measure(args.rollouts, args.inflight, args.repeats)
    print(
        f"{res['records']} records, {res['pages_per_round']} pages of <= {res['uids_per_page']} "
        f"uids: buffer {res['buffer_ms_per_round']} ms a round "
        f"({res['buffer_core_s_per_s']} core-s/s), manager {res['manager_judge_ms_per_round']} ms "
        f"({res['manager_core_s_per_s']} core-s/s) at one round every {res['period_s']} s"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"bench": "reconcile_cost", "args": vars(args) | {"out": str(args.out)}, **res},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

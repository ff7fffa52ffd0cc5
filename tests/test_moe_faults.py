"""kill -9 of an MoE rollout process mid-trajectory: the resumed trajectory's routes are exactly
what the engines recorded: the dead one's for every position the partial pool held, the
resumer's after.

    .venv/bin/python -m pytest tests/test_moe_faults.py -q -m slow      (~30 s: four processes)

Real processes over ipc in a private directory (tests/procs.py): manager, buffer, rollout-0 and
rollout-1, each `laminar node` on the torch engine and the tiny Qwen3-MoE, through
tests/moe_faults.py, which logs every route the engine hands the node. rollout-0 stops inside a
decode step (its event loop still streams what it recorded to the partial pool) and is killed
with SIGKILL once its log says everything was streamed. rollout-1 serves the same policy with its
routers moved (as a newer version would have them), so it routes the prefix otherwise: a
resumed trajectory whose prefix routes equal rollout-0's got them from the pool, not from the
resumer's prefill. The stored trajectories are read back from the buffer's journal (what the
trainer would be handed).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from laminar.buffer.journal_format import read_records
from laminar.buffer.records import TrajectoryAccepted
from laminar.models.tiny import build_tiny_model, load_tokenizer
from laminar.tasks import countup
from tests.moe_faults import read_log
from tests.procs import Procs
from tests.sim_cluster import PROCESS_FAULT_TRANSPORT
from tests.test_e2e_rollout import PROMPTS
from tests.test_moe import _perturbed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "moe_faults.py")


def first_records(log: Path) -> dict[str, np.ndarray]:
    """uid -> the route of each position as the node keeps it: the first engine event that
    recorded the position (an event past the record's end leaves a gap: not kept)."""
    out: dict[str, list[np.ndarray]] = {}
    for rec in read_log(log):
        if rec[0] == "event":
            _, uid, start, routes = rec
            have = out.setdefault(uid, [])
            if start <= len(have):
                have.extend(routes[len(have) - start :])
    return {u: np.stack(v) for u, v in out.items() if v}


def records(log: Path, kind: str) -> list[tuple]:
    return [r for r in read_log(log) if r[0] == kind]


def config(tmp: Path, ipc_dir: Path, model: Path) -> dict:
    data = tmp / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": countup.answer_of(p)}) + "\n" for p in PROMPTS)
    )
    return {
        "name": "moe-kill9",
        "run_dir": str(tmp / "run"),
        "cluster": {
            "transport": "ipc",
            "ipc_dir": str(ipc_dir),
            "roles": {"manager": 1, "buffer": 1, "relay": 0, "trainer": 0, "rollout": 2},
        },
        "transport": dict(PROCESS_FAULT_TRANSPORT),
        "model": {"path": str(model)},
        "data": {"train": str(data), "epochs": 1, "shuffle": False, "chat_template": False},
        "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0, "timeout_s": 10.0},
        "rollout": {
            "engine": "torch",
            "group_size": 2,
            "credits": 2,
            "max_running": 4,
            "partial_chunk_tokens": 2,
            "partial_flush_s": 0.02,
            "weights": "dir",
            "prompt_retry_s": 0.1,
            "sampling": {"max_tokens": 40, "temperature": 1.0},
        },
        "buffer": {"fsync": "always", "retry_after_s": 0.1},
        "logging": {"level": "info"},
    }


def test_routes_survive_a_rollout_process_killed_mid_trajectory(tmp_path, short_dir):
    model = build_tiny_model(
        tmp_path / "m", hidden=32, layers=2, heads=2, kv_heads=1, kind="moe", experts=8
    )
    moved = tmp_path / "moved"
    _perturbed(model, scale=0.5).save_pretrained(moved, safe_serialization=True)
    load_tokenizer(model).save_pretrained(moved)
    procs = Procs(tmp_path, config(tmp_path, short_dir, model))
    victim_log, resumer_log = tmp_path / "rollout-0.routes", tmp_path / "rollout-1.routes"
    hold = tmp_path / "hold"
    hold.mkdir()
    try:
        procs.start("manager", "manager")
        procs.start("buffer", "buffer")
        victim = [SCRIPT, "log", str(victim_log), "hold", str(hold), "12"]
        procs.start("rollout-0", "rollout", 0, via=victim)
        procs.wait(lambda: (hold / "holding").exists(), "rollout-0 stopped mid-generation")
        resumer = [SCRIPT, "log", str(resumer_log)]
        procs.start("rollout-1", "rollout", 1, via=resumer, over=[f"model.path={moved}"])
        procs.wait_registered({"buffer-0", "rollout-0", "rollout-1"})

        def streamed() -> dict[str, int] | None:
            """rollout-0's in-flight uids -> routes streamed, once that is all it recorded."""
            rec, sent = first_records(victim_log), records(victim_log, "flushed")
            last = sent[-1][1] if sent else {}
            done = last and all(n == len(rec.get(u, ())) for u, n in last.items())
            return last if done else None

        sent = procs.wait(streamed, "rollout-0 streaming what its engine recorded")
        procs.kill9("rollout-0")
        victim_routes = first_records(victim_log)

        def imported() -> dict[str, np.ndarray] | None:
            got = {r[1]: r[2] for r in records(resumer_log, "import") if r[1] in sent}
            return got if set(got) == set(sent) else None

        imports = procs.wait(imported, "rollout-1 resuming rollout-0's trajectories")
        journal = procs.run_dir / "buffer-0.journal"

        def stored() -> dict | None:
            # read-only beside the live buffer (which holds the journal's lock)
            trajs = [
                r.trajectory for r in read_records(journal) if isinstance(r, TrajectoryAccepted)
            ]
            got = {t.uid: t for t in trajs if t.uid in sent}
            return got if set(got) == set(sent) else None

        finished = procs.wait(stored, "the resumed trajectories stored")
    finally:
        procs.stop_all()
    resumer_routes = first_records(resumer_log)
    prefixes, differs = [], False
    for uid, t in finished.items():
        p, s = len(t.prompt_ids), len(imports[uid])
        assert t.rollout_id == "rollout-1" and t.resumed == 1, uid
        assert t.routes.shape == (p + len(t.response_ids) - 1, 2, 2), uid
        # the pool held rollout-0's records, as far as they were streamed
        assert 0 < s <= sent[uid]
        np.testing.assert_array_equal(imports[uid], victim_routes[uid][:s])
        # stored: rollout-0's engine for every position the pool held, rollout-1's after
        np.testing.assert_array_equal(t.routes[:s], victim_routes[uid][:s])
        np.testing.assert_array_equal(t.routes[s:], resumer_routes[uid][s : len(t.routes)])
        prefixes.append(s - p)
        mine = np.sort(resumer_routes[uid][:s], -1)
        differs |= bool((mine != np.sort(victim_routes[uid][:s], -1)).any())
    print(f"\nresumed {len(finished)}: routes of response tokens from the dead rollout {prefixes}")
    assert max(prefixes) > 0, "the pool held routes of streamed response tokens"
    # the resumer would have routed the prefix otherwise: those routes came from the dead engine
    assert differs

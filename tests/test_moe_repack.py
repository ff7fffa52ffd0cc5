"""A repack move of MoE trajectories between two rollout nodes: the stored routes are exactly what
the engines recorded, the source's for every position it exported, the destination's after.

    .venv/bin/python -m pytest tests/test_moe_repack.py -q

The manager's command path (tests/rollout_fakes.py harness: a real ManagerNode, a fake buffer):
ExportRequest to rollout-0 (abort, hand over), ImportRequest to rollout-1 (resume), both nodes on
the torch engine and the tiny Qwen3-MoE. rollout-1 serves the policy with its routers moved, so
its prefill routes the moved prefix otherwise: a prefix whose routes equal rollout-0's came with
the export. rollout-0's engine stops inside a decode step until the export is on its way, so the
trajectories are mid-generation when they move, every run.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from rollout_fakes import harness, make_cfg, make_items, uids_of

from laminar.engines.torch_engine import TorchEngine
from laminar.models.tiny import build_tiny_model, load_causal_lm
from laminar.protocol.rollout import ExportRequest, ImportRequest
from laminar.rollout.node import RolloutNode
from tests.test_moe import _perturbed

HOLD_AT_STEP = 12
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "m", hidden=32, layers=2, kind="moe", experts=8
    )


def engine(model: Any) -> TorchEngine:
    # no end-of-sequence token: every trajectory runs to max_tokens
    return TorchEngine(model, None, max_running=8, max_model_len=128, eos_token_ids=[])


def record_events(node: RolloutNode) -> dict[str, list[np.ndarray]]:
    """uid -> the routes of each position as the node's engine first recorded them (every engine
    event passes through the sequence table's on_event)."""
    out: dict[str, list[np.ndarray]] = {}
    on_event = node.table.on_event

    def recording(ev: Any) -> Any:
        if ev.routes is not None:
            have = out.setdefault(ev.seq_id, [])
            if ev.route_start <= len(have):
                have.extend(ev.routes[len(have) - ev.route_start :])
        return on_event(ev)

    node.table.on_event = recording  # type: ignore[method-assign]
    return out


def hold_decoding(eng: TorchEngine) -> tuple[threading.Event, threading.Event]:
    """(holding, go): the engine's HOLD_AT_STEP-th step (its worker thread) sets `holding` and
    waits for `go`; its event loop and the node's stay free."""
    holding, go = threading.Event(), threading.Event()
    compute, steps = eng._compute, [0]

    def held(batch: Any) -> Any:
        steps[0] += 1
        if steps[0] == HOLD_AT_STEP:
            holding.set()
            go.wait(DEADLINE_S)
        return compute(batch)

    eng._compute = held  # type: ignore[method-assign]
    return holding, go


async def test_routes_survive_a_repack_move(tmp_path, moe_path):
    items = make_items(2, n=2)
    uids = uids_of(items)
    cfg = make_cfg(
        tmp_path,
        model={"path": str(moe_path)},
        rollout__engine="torch",
        rollout__sampling={"max_tokens": 40, "temperature": 1.0},
    )
    async with harness(cfg, items) as h:
        src_engine = engine(load_causal_lm(moe_path))
        holding, go = hold_decoding(src_engine)
        src = await h.add_rollout(src_engine)  # type: ignore[arg-type]
        src_routes = record_events(src)
        await asyncio.wait_for(asyncio.to_thread(holding.wait, DEADLINE_S), DEADLINE_S)
        assert set(src.table.seqs) == uids
        dst = await h.add_rollout(engine(_perturbed(moe_path, scale=0.5)))  # type: ignore[arg-type]
        dst_routes = record_events(dst)
        export = asyncio.create_task(
            h.manager.srv.request("rollout-0", ExportRequest(uids=sorted(uids)), timeout=10)
        )
        go.set()  # the held step ends; the abort runs before the next one
        exp = await export
        assert {p.uid for p in exp.partials} == uids and not src.table.seqs
        imp = await h.manager.srv.request(
            "rollout-1", ImportRequest(partials=exp.partials), timeout=10
        )
        assert set(imp.accepted) == uids
        await h.wait_stored(uids, DEADLINE_S)
    differs = False
    moved = {p.uid: (len(p.response_ids), len(p.routes)) for p in exp.partials}
    print(f"\nmoved (tokens, routed positions): {moved}")
    for p in exp.partials:
        t = h.state.stored[p.uid]
        n_prompt, m = len(t.prompt_ids), len(p.routes)
        mine, theirs = np.stack(src_routes[p.uid]), np.stack(dst_routes[p.uid])
        assert t.rollout_id == "rollout-1" and t.resumed == 1
        assert 0 < len(p.response_ids) < 40 and m > n_prompt, "moved mid-generation"
        np.testing.assert_array_equal(t.response_ids[: len(p.response_ids)], p.response_ids)
        assert t.routes.shape == (n_prompt + len(t.response_ids) - 1, 2, 2)
        # the export: everything rollout-0's engine recorded for the tokens it hands over
        np.testing.assert_array_equal(p.routes, mine[:m])
        # stored: rollout-0's records of the moved prefix, rollout-1's after
        np.testing.assert_array_equal(t.routes[:m], mine[:m])
        np.testing.assert_array_equal(t.routes[m:], theirs[m : len(t.routes)])
        differs |= bool((np.sort(theirs[:m], -1) != np.sort(mine[:m], -1)).any())
    # rollout-1 would have routed the prefix otherwise: those routes came with the export
    assert differs

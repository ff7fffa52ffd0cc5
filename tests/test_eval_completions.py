"""Periodic validation on data.eval and the completions log (laminar/trainer/evaluation.py,
logger.py).

    .venv/bin/python -m pytest tests/test_eval_completions.py -q

The trainer's evaluator is checked against the demos' entry to the same held-out evaluator
(laminar/tasks/evaluate.py: evaluate_model, its own prompt encoding and verifier) on the same
rows and weights; the trainer node runs against the fake buffer/manager of
tests/test_trainer_node.py with a tiny countup model and a handful of eval rows.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from laminar.config import LaminarConfig, config_from_dict
from laminar.tasks import countup
from laminar.transport.sockets import new_context
from laminar.wiring.common import socket_options
from laminar.wiring.nodes import build_node
from tests.test_trainer import make_trajs
from tests.test_trainer_node import FakeBuffer, FakeManager, groups_of

EVAL_ROWS = 5


class Recorder:
    """A structlog-shaped logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def _rec(self, level: str):
        return lambda event, **kw: self.lines.append((level, event, kw))

    def __getattr__(self, level: str):
        return self._rec(level)

    def events(self) -> list[str]:
        return [e for _, e, _ in self.lines]


@pytest.fixture(scope="module")
def countup_model(tmp_path_factory) -> tuple[str, str]:
    from laminar.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("evalmodel")
    kw = dict(
        alphabet=countup.ALPHABET, hidden=32, layers=1, heads=2, kv_heads=1, max_positions=128
    )
    a = build_tiny_model(root / "a", seed=0, initializer_range=0.5, **kw)
    b = build_tiny_model(root / "b", seed=1, initializer_range=0.5, **kw)
    return str(a), str(b)


def cfg_for(tmp_path: Path, model: str, **trainer: Any) -> LaminarConfig:
    rows = countup.generate(EVAL_ROWS + 3, "eval", 0)
    data = countup.write_jsonl(rows, tmp_path / "eval.jsonl")
    t = {
        "lr": 1e-3,
        "total_steps": 2,
        "batch_groups": 2,
        "batch_wait_s": 0.2,
        "micro_batch_tokens": 256,
        "eval_every": 1,
        "eval_rows": EVAL_ROWS,
        "completions_per_step": 2,
        **trainer,
    }
    return config_from_dict(
        {
            "name": f"ev{abs(hash(str(tmp_path))) % 10**8}",
            "run_dir": str(tmp_path / "run"),
            "model": {"path": model},
            "data": {"eval": str(data)},
            "trainer": t,
            "reward": {"fn": "laminar.tasks.countup:reward", "workers": 0},
            "cluster": {"transport": "inproc", "roles": {"relay": 0}},
            "transport": {
                "heartbeat_interval_s": 0.05,
                "request_timeout_s": 2.0,
                "startup_timeout_s": 5.0,
            },
            "rollout": {"sampling": {"max_tokens": 24}},
        }
    )


async def test_evaluator_scores_greedy_completions_of_the_weights_it_is_given(
    countup_model, tmp_path
):
    from laminar.models.tiny import load_causal_lm
    from laminar.tasks.evaluate import evaluate_model
    from laminar.trainer.evaluation import open_evaluator
    from laminar.wiring.trainer import eval_settings

    a, b = countup_model
    cfg = cfg_for(tmp_path, a, completions_per_step=EVAL_ROWS)
    log = Recorder()
    ev = await asyncio.to_thread(open_evaluator, eval_settings(cfg), log)
    assert ev is not None and len(ev.task.prompts) == EVAL_ROWS and "eval_ready" in log.events()
    rows = countup.generate(EVAL_ROWS + 3, "eval", 0)[:EVAL_ROWS]
    await ev.start()
    try:
        seen = []
        for path in (a, b):  # b's weights through the same eval model: its outputs, not a's
            weights = load_causal_lm(path).state_dict()
            metrics, samples = await ev.run(weights, step=7)
            ref = await asyncio.to_thread(evaluate_model, path, rows, countup.verify, max_tokens=24)
            assert [s["completion"] for s in samples] == ref["completions"]
            assert metrics["eval/n"] == EVAL_ROWS and metrics["eval/excluded"] == 0
            assert metrics["eval/accuracy"] == pytest.approx(ref["accuracy"])
            assert all(s["step"] == 7 and s["eval"] for s in samples)
            seen.append(ref["completions"])
        assert seen[0] != seen[1]  # two different models: the comparison above is not vacuous
    finally:
        await ev.close()


def test_evaluator_is_skipped_with_a_reason(countup_model, tmp_path):
    from laminar.trainer.evaluation import open_evaluator
    from laminar.wiring.trainer import eval_settings

    a, _ = countup_model
    log = Recorder()
    cfg = cfg_for(tmp_path, a, engine="sim")
    assert open_evaluator(eval_settings(cfg), log) is None
    assert any(e == "eval_skipped" and "sim" in kw["reason"] for _, e, kw in log.lines)
    assert open_evaluator(eval_settings(cfg_for(tmp_path, a, eval_every=0)), log) is None
    cfg = cfg_for(tmp_path, a)
    cfg.env.fn = "laminar.envs.tool_env:ToolEnv"
    assert (
        open_evaluator(eval_settings(cfg), log) is not None and "eval_single_turn" in log.events()
    )


async def test_trainer_writes_eval_metrics_and_completions(countup_model, tmp_path):

    a, _ = countup_model
    cfg = cfg_for(tmp_path, a)
    trajs = make_trajs(n_groups=4, group=2, vocab=(4, 21))
    for t in trajs:
        t.prompt, t.completion = f"prompt of {t.group_id}", f"completion {t.uid}"
    ctx = new_context()
    opts = socket_options(cfg)
    buf = FakeBuffer(ctx, cfg.endpoint("buffer"), opts, groups_of(trajs))
    mgr = FakeManager(ctx, cfg.endpoint("manager"), opts)
    await buf.srv.start()
    await mgr.srv.start()
    try:
        node = build_node(cfg, "trainer", ctx=ctx)
        await asyncio.wait_for(node.run(), 90)
    finally:
        await buf.srv.close()
        await mgr.srv.close()
        ctx.destroy(linger=0)
    assert node.step == 2
    run = cfg.resolved_run_dir()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]  # 0: before the first step
    assert all(m["eval/n"] == EVAL_ROWS and 0.0 <= m["eval/accuracy"] <= 1.0 for m in evals)
    assert [m["step"] for m in lines if "reward" in m] == [1, 2]
    recs = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    train = [r for r in recs if not r.get("eval")]
    assert [r["step"] for r in train] == [1, 1, 2, 2]
    by_uid = {t.uid: t for t in trajs}
    for r in train:
        t = by_uid[r["uid"]]
        got = (r["prompt"], r["completion"], r["reward"], r["version"])
        assert got == (t.prompt, t.completion, t.reward, 0)
        assert r["trainer_version"] == r["step"]
    # spread over the batch, not one sample twice
    assert len({r["uid"] for r in train if r["step"] == 1}) == 2
    assert [r["step"] for r in recs if r.get("eval")] == [0, 0, 1, 1, 2, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert "eval/accuracy" in acc.Tags()["scalars"]
    assert any("completions" in tag for tag in acc.Tags()["tensors"])

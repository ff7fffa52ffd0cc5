"""Reward runner: sync/async/dict/None/raising/timing-out rewards, hung and dead workers.

    .venv/bin/python -m pytest tests/test_reward_runner.py -q

The reward functions live in this module and are referenced as f"{__name__}:fn", so
spawned worker processes import them the same way a user's `module:function` is.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from laminar.config import ConfigError
from laminar.rewards.runner import RewardRunner, RewardSpecError, normalize_reward

HERE = __name__


# ---- reward functions under test ---------------------------------------------------------


def sync_match(prompt, completion, answer=None, **row):
    return float(completion.strip() == str(answer))


async def async_match(prompt, completion, answer=None, **row):
    await asyncio.sleep(0)
    return 1.0 if completion.strip() == str(answer) else 0.0


def dict_reward(prompt, completion, **row):
    return {"reward": np.float32(0.5), "format": 1.0, "note": "ok", "n": np.int64(3)}


def single_value_dict(prompt, completion, **row):
    return {"accuracy": 1}


def ambiguous_dict(prompt, completion, **row):
    return {"a": 1.0, "b": 0.0}


def noisy(prompt, completion, **row):
    print("a reward that prints " * 50)  # must not corrupt the worker's protocol stream
    return 1.0


def none_reward(prompt, completion, **row):
    return None


def raising(prompt, completion, **row):
    raise ValueError("bad completion " + completion)


def wrong_type(prompt, completion, **row):
    return "1.0"


def nan_reward(prompt, completion, **row):
    return float("nan")


def sleepy(prompt, completion, seconds=0.0, **row):
    time.sleep(float(seconds))
    return 1.0


async def async_sleepy(prompt, completion, seconds=0.0, **row):
    await asyncio.sleep(float(seconds))
    return 1.0


def suicidal(prompt, completion, **row):
    os._exit(3)


def whoami(prompt, completion, **row):
    return {"reward": 1.0, "pid": os.getpid()}


NOT_CALLABLE = 42


# ---- tests -------------------------------------------------------------------------------


def test_normalize_reward_rules():
    assert normalize_reward(None) == (None, {})
    assert normalize_reward(True) == (1.0, {})
    assert normalize_reward(np.float64(0.25)) == (0.25, {})
    assert normalize_reward({"reward": 1, "format": 0.0}) == (1.0, {"format": 0.0})
    assert normalize_reward({"reward": None, "why": "no ref"}) == (None, {"why": "no ref"})
    assert normalize_reward({"acc": 0.5, "tag": "x"}) == (0.5, {"acc": 0.5, "tag": "x"})
    for bad in ("1", [1.0], {"a": 1.0, "b": 2.0}, {}, float("inf"), {"reward": "x"}):
        with pytest.raises(ValueError):
            normalize_reward(bad)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_colon_here", "must look like"),
        ("a:b:c", "must look like"),
        ("laminar.no_such_module_xyz:fn", "cannot import module"),
        (f"{HERE}:missing_fn", "has no 'missing_fn'"),
        (f"{HERE}:NOT_CALLABLE", "not a function"),
    ],
)
async def test_bad_spec_is_a_clear_config_error(spec, fragment):
    runner = RewardRunner(spec, timeout_s=1.0, workers=0)
    with pytest.raises(RewardSpecError, match=fragment) as info:
        await runner.start()
    assert isinstance(info.value, ConfigError)
    await runner.close()


NAMES = (
    "sync_match",
    "async_match",
    "dict_reward",
    "single_value_dict",
    "ambiguous_dict",
    "none_reward",
    "raising",
    "wrong_type",
    "nan_reward",
    "noisy",
)


def dispatch(prompt, completion, kind="", **row):
    """One function that behaves like each of the above (one worker process serves every case)."""
    return globals()[kind](prompt, completion, **row)


@pytest.mark.parametrize("workers", [0, 1])
async def test_sync_async_dict_none_raising(workers):
    # row carries a "prompt" key as dataset rows do: it must not collide with the argument
    row = {"answer": "4", "prompt": "dup"}
    if workers == 0:  # one runner per function: also covers `async def` detection
        runners = [RewardRunner(f"{HERE}:{name}", timeout_s=5.0, workers=0) for name in NAMES]
        try:
            await asyncio.gather(*(r.start() for r in runners))
            scores = await asyncio.gather(*(r.score("2+2?", "4", row) for r in runners))
        finally:
            await asyncio.gather(*(r.close() for r in runners))
    else:  # one worker process; an async function's coroutine runs on the worker's loop
        runner = RewardRunner(f"{HERE}:dispatch", timeout_s=5.0, workers=1)
        await runner.start()
        try:
            scores = [await runner.score("2+2?", "4", {**row, "kind": name}) for name in NAMES]
        finally:
            await runner.close()
        assert runner.stats["replaced"] == 0  # failures of the function never cost the worker
    results = dict(zip(NAMES, scores, strict=True))
    assert results["sync_match"].reward == 1.0 and not results["sync_match"].failed
    assert results["async_match"].reward == 1.0
    assert results["noisy"].reward == 1.0 and not results["noisy"].failed
    assert results["dict_reward"].reward == 0.5
    assert results["dict_reward"].info == {"format": 1.0, "note": "ok", "n": 3}
    assert results["single_value_dict"].reward == 1.0
    assert results["none_reward"].reward is None and results["none_reward"].info == {}
    assert results["raising"].reward is None
    assert results["raising"].error_kind == "exception" and results["raising"].info == {}
    assert "ValueError: bad completion 4" in results["raising"].error
    for name in ("ambiguous_dict", "wrong_type", "nan_reward"):
        assert results[name].reward is None and results[name].error_kind == "format", name


async def test_counters():
    runner = RewardRunner(f"{HERE}:sync_match", timeout_s=5.0, workers=0)
    await runner.start()
    try:
        for completion in ("4", "5", "4"):
            await runner.score("q", completion, {"answer": "4"})
    finally:
        await runner.close()
    assert runner.stats["calls"] == 3 and runner.stats["ok"] == 3 and runner.stats["errors"] == 0


@pytest.mark.parametrize("name", ["sleepy", "async_sleepy"])
async def test_thread_mode_timeout_marks_sample_and_loop_keeps_running(name):
    runner = RewardRunner(f"{HERE}:{name}", timeout_s=0.3, workers=0)
    await runner.start()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)  # the thing measured: the loop keeps turning
            ticks += 1

    t = asyncio.create_task(ticker())
    try:
        t0 = time.monotonic()
        res = await runner.score("p", "c", {"seconds": 1.5})
        took = time.monotonic() - t0
        ok = await runner.score("p", "c", {"seconds": 0})
    finally:
        t.cancel()
        await runner.close()
    assert res.reward is None and res.error_kind == "timeout"
    assert took < 1.0
    assert ticks >= 10, "the event loop stalled while the reward ran"
    assert ok.reward == 1.0
    assert runner.stats["timeouts"] == 1
    assert runner.stats["stuck"] == (1 if name == "sleepy" else 0)


async def test_hung_worker_is_killed_and_replaced():
    runner = RewardRunner(f"{HERE}:sleepy", timeout_s=0.5, workers=1)
    await runner.start()
    try:
        (old_pid,) = runner.worker_pids
        t0 = time.monotonic()
        res = await runner.score("p", "c", {"seconds": 60})
        assert time.monotonic() - t0 < 5.0
        assert res.reward is None and res.error_kind == "timeout"
        assert runner.stats["replaced"] == 1
        await runner.wait_workers(60)
        (new_pid,) = runner.worker_pids
        assert new_pid != old_pid
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)  # the hung process is gone, not leaked
        ok = await runner.score("p", "c", {"seconds": 0})
        assert ok.reward == 1.0 and not ok.failed
    finally:
        await runner.close()


async def test_dead_worker_is_replaced():
    runner = RewardRunner(f"{HERE}:suicidal", timeout_s=5.0, workers=1)
    await runner.start()
    try:
        res = await runner.score("p", "c", {})
        assert res.reward is None and res.error_kind == "worker_died"
        await runner.wait_workers(60)
        assert runner.stats["replaced"] == 1 and len(runner.worker_pids) == 1
    finally:
        await runner.close()


async def test_process_workers_run_in_parallel_and_off_process():
    runner = RewardRunner(f"{HERE}:whoami", timeout_s=5.0, workers=2)
    await runner.start()
    try:
        results = await asyncio.gather(*(runner.score("p", "c", {}) for _ in range(6)))
    finally:
        await runner.close()
    pids = {r.info["pid"] for r in results}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert all(r.reward == 1.0 for r in results)

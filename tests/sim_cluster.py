"""Helpers for the manager / modes / fault tests: a sim-only cluster config and run-dir readers.

    cfg = sim_config(tmp_path, mode="sync", rollouts=3, total_steps=6)   # sim engines, sim trainer
    async with LocalCluster(cfg) as cluster: ...
    steps = consumed(cfg)           # trainer run_dir/consumed.jsonl: [{"step", "version", "uids"}]
    metrics = trainer_metrics(cfg)  # trainer run_dir/metrics.jsonl (per-step staleness histograms)
    proc = laminar_run(cfg, tmp_path)   # `laminar run` of it as a process over ipc

No model, no tokenizer: prompts are byte ids, rewards a uid hash, and the sim trainer's step
time is proportional to the tokens it consumes, so a whole cluster runs in a few seconds on CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from laminar.config import LaminarConfig, config_from_dict

PROCESS_FAULT_TRANSPORT: dict[str, Any] = {
    "heartbeat_interval_s": 0.25,
    "heartbeat_liveness": 8,
    "request_timeout_s": 2.0,
    "startup_timeout_s": 90.0,
    "stop_timeout_s": 3.0,
    "reconnect_backoff_s": 0.05,
    "reconnect_backoff_max_s": 0.5,
}
"""Transport settings of the fault tests that kill real node processes (test_faults,
test_multiturn_faults, test_agent_faults): fast death detection, a start-up bound for a loaded
box."""


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"prompt {i:05d}"}) + "\n" for i in range(n)))
    return path


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


def sim_config(
    tmp: Path,
    *,
    mode: str = "laminar",
    rollouts: int = 2,
    relays: int = 0,
    total_steps: int = 5,
    prompts: int = 400,
    net: str = "inproc",
    **over: Any,
) -> LaminarConfig:
    """A small all-sim cluster; `over` is merged into the config dict (nested sections merge)."""
    data = write_prompts(tmp / "prompts.jsonl", prompts)
    base = {
        "name": f"t{abs(hash(str(tmp))) % 10**8}",
        "mode": mode,
        "run_dir": str(tmp / "run"),
        "cluster": {
            "transport": net,
            "ipc_dir": str(tmp / "ipc") if net == "ipc" else None,
            "roles": {
                "manager": 1,
                "buffer": 1,
                "relay": relays,
                "trainer": 1,
                "rollout": rollouts,
            },
        },
        # 2 busy cores: a node is dead after 2 s of silence (the default), beats every 0.25 s
        "transport": {
            "heartbeat_interval_s": 0.25,
            "heartbeat_liveness": 8,
            "request_timeout_s": 2.0,
            "startup_timeout_s": 60.0,
            "stop_timeout_s": 3.0,
            "reconnect_backoff_s": 0.02,
            "reconnect_backoff_max_s": 0.2,
        },
        "data": {"train": str(data), "shuffle": False},
        "rollout": {
            "engine": "sim",
            "group_size": 2,
            "credits": 2,
            "max_running": 8,
            "partial_chunk_tokens": 8,
            "prompt_retry_s": 0.05,
            "refresh_wait_s": 2.0,
            "sampling": {"max_tokens": 120},
            "sim": {
                "step_time_s": 0.002,
                "bound_b": 8,
                "length_p50": 20,
                "length_p99_over_p50": 6,
                "kv_capacity_tokens": 8 * 140,
            },
        },
        "trainer": {
            "engine": "sim",
            "batch_groups": 2,
            "total_steps": total_steps,
            "sim_time_per_token_s": 1e-5,
            "batch_wait_s": 0.5,
        },
        "buffer": {"fsync": "never", "retry_after_s": 0.05},
        "manager": {"repack": {"interval_s": 0.5}, "timeline_interval_s": 0.5},
        "logging": {"level": "warning"},
    }
    return config_from_dict(merge(base, over))


def laminar_run(cfg: LaminarConfig, tmp: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """`laminar run` of cfg as a process, over ipc in its default directory (a pytest tmp path
    is too long for a socket's name), without the progress line; its output captured."""
    import yaml

    dump = cfg.model_dump(mode="json")
    dump["cluster"].update(transport="ipc", ipc_dir=None)
    dump["logging"]["progress_every_s"] = 0
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(dump))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "laminar", "run", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def consumed(cfg: LaminarConfig) -> list[dict[str, Any]]:
    return read_jsonl(cfg.resolved_run_dir() / "consumed.jsonl")


def trainer_metrics(cfg: LaminarConfig) -> list[dict[str, Any]]:
    return read_jsonl(cfg.resolved_run_dir() / "metrics.jsonl")


def staleness_hist(metrics: list[dict[str, Any]]) -> dict[int, int]:
    """Staleness at consumption over every logged step: {staleness: trajectories}."""
    out: dict[int, int] = {}
    for m in metrics:
        for k, v in m.items():
            if k.startswith("staleness_hist/"):
                s = int(k.split("/", 1)[1])
                out[s] = out.get(s, 0) + int(v)
    return out


async def wait_for(
    cond: Any, timeout: float, what: str, cluster: Any = None, every: float = 0.05
) -> float:
    """Poll `cond` (a state with no event of its own) against a deadline; returns the time it
    took."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not cond():
        if cluster is not None:
            cluster.check()
        if loop.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)  # poll interval of a deadline-bounded condition wait
    return loop.time() - t0

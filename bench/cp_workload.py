"""The control-plane bench's workload: the message rates of a 1024-GPU job, from the simulator's
results (bench/results/simulate.json), and the rollout settings they follow. bench/cp_driver.py
offers them; the derivation is in bench/control_plane.py's docstring."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

CHUNK_TOKENS = 32
FLUSH_S = float(os.environ.get("CP_FLUSH_S", "1.0"))
"""rollout.partial_flush_s's default (tests/test_partial_batch.py checks they agree); CP_FLUSH_S
changes it (entry_tokens follows: a sequence faster than a chunk a window sends one entry a window,
so a longer window sends fewer batches and fewer, longer entries)."""
ENTRY_TOKENS = int(os.environ.get("CP_ENTRY_TOKENS", "0"))
"""Tokens per partial entry (0: from the row's decode speed, entry_tokens below). CP_ENTRY_TOKENS=32
reproduces the model of the figures before 2026-12-07: one entry per CHUNK_TOKENS of every
sequence, as if each sequence decoded exactly CHUNK_TOKENS per flush window."""
HEARTBEAT_S = 0.5
STATUS_PUSH_MIN_S = 0.05


def entry_tokens(seq_tok_s: float, flush_s: float = FLUSH_S, chunk: int = CHUNK_TOKENS) -> float:
    """Tokens one partial entry carries, for a sequence decoding seq_tok_s: a rollout marks a
    sequence once it has `chunk` unsent tokens (laminar/rollout/node.py) and each flush window
    sends every marked sequence's unsent tokens as one entry (laminar/rollout/deliver.py). So a
    sequence that decodes at least `chunk` tokens a window sends one entry a window with all of
    them, and a slower one an entry every ceil(chunk / its tokens a window) windows."""
    per_window = seq_tok_s * flush_s
    if per_window <= 0:
        return float(chunk)
    return per_window * math.ceil(chunk / per_window - 1e-9)


def seq_tok_s(model: str) -> float:
    """One sequence's decode speed on a laminar rollout of the simulator's model (its decode step
    at up to bound_b sequences, bench/simscale.py; the 1024-GPU rows decode below bound_b); 0 when
    the model is not known."""
    from simscale import MODELS

    spec = MODELS.get(model.split("_")[0])
    return 0.0 if spec is None else 1.0 / spec.step_time_s[spec.tp_laminar]


def tool_calls_per_trajectory(name: str) -> float:
    """Mean tool calls of a multi-turn row's trajectory (bench/simscale.py MULTITURN: another call
    with p_call, at most tool_calls_max); 0 for a single-turn row. Each call ends a model turn,
    and the turn's end goes to the partial pool as an entry of its own (awaiting_env), whatever
    tokens it brings."""
    if not name.endswith("_multiturn"):
        return 0.0
    from simscale import MULTITURN

    p, most = MULTITURN["p_call"], MULTITURN["tool_calls_max"]
    return sum(p**k for k in range(1, most + 1))


def workload_rates(sim_json: Path) -> dict[str, dict[str, float]]:
    """Message rates of every 1024-GPU laminar row of the simulator results (see the docstring)."""
    d = json.loads(sim_json.read_text())
    rows: dict[str, dict[str, Any]] = {}
    for model, by_scale in d.get("results", {}).items():
        if "1024" in by_scale:
            rows[model] = by_scale["1024"]["laminar"]
    mt = d.get("multiturn", {})
    if "1024" in mt.get("results", {}):
        rows[f"{mt.get('model', '?')}_multiturn"] = mt["results"]["1024"]["laminar"]
    out = {}
    for name, r in rows.items():
        tok_s = r["gen_tok_s"]["median"]
        window = r["counts"]["steps_measured"] * r["iteration_s"]["median"]
        traj_s = r["staleness_finished"]["count"] / window
        n = r["rollouts"]
        speed = seq_tok_s(name)
        per_entry = float(ENTRY_TOKENS) if ENTRY_TOKENS else entry_tokens(speed)
        out[name] = {
            "rollouts": n,
            "tokens_s": tok_s,
            "trajectories_s": traj_s,
            "seq_tok_s": speed,
            "entry_tokens": per_entry,
            "chunks_s": tok_s / per_entry + traj_s * tool_calls_per_trajectory(name),
            "batches_s": n / FLUSH_S,
            "heartbeats_s": n / HEARTBEAT_S,
            "status_pushes_s": n / STATUS_PUSH_MIN_S,
        }
    return out

"""The control-plane bench's figures from its stored cost passes (bench/control_plane.py runs
them): each node's CPU per 1x above idle, per message kind and in all, the one-core-per-node
estimate, the handlers' CPU per kind, the manager's CPU per status push, and per buffer shard per
trajectory by K. Pure functions of the passes' dicts, so a stored run can be read again.

    sm = cost_summary(passes, rates)       # per node, per kind (each the median of its passes)
    sm.update(shard_figures(passes, rates))  # per shard per trajectory by K, medians of rounds
"""

from __future__ import annotations

import statistics
from typing import Any

COST_PHASES = ("status", "trajectory", "chunk", "all")
"""The cost phases at 1x, in order: status pushes alone; trajectories alone (served samples
finished without partials, the trainer taking them); the partial stream alone (no sample
finishes; last of a pass, since its samples then grow past a trajectory's length); the whole
workload, in a pass of its own (run_bench). Before them, after the first fill, an idle phase as
long (the background alone: heartbeats, prompt supply, the trainer) gives the idle subtracted
from each, and one after them is kept as a check on drift; before each phase the driver waits
(bounded) until the trajectories it sent were acked, so none spills into the next phase."""
HANDLER_KINDS = {
    "PartialBatch": "chunk",
    "PartialChunk": "chunk",
    "Trajectory": "trajectory",
    "TrajectoryAbandoned": "trajectory",
    "Deliveries": "trajectory",
    "BatchRequest": "batch",
    "BatchCommit": "batch",
    "PromptRequest": "prompt",
}


def cost_summary(passes: list[dict[str, Any]], rates: dict[str, float]) -> dict[str, Any]:
    """The cost figures from the cost passes (see the module docstring): per node per 1x above
    idle (the K=1 pass), per kind, the one-core estimate, and per shard per trajectory by K."""
    load_of = {  # a phase's load as a fraction of 1x, from what was delivered
        "all": lambda g: g["batches"] / rates["batches_s"],
        "status": lambda g: g["pushes"] / rates["status_pushes_s"],
        "trajectory": lambda g: g["acked"] / rates["trajectories_s"],
        "chunk": lambda g: g["batches"] / rates["batches_s"],
    }
    out: dict[str, Any] = {}
    ones = [p for p in passes if p["buffer_shards"] == 1 and p.get("x", 1.0) == 1.0] or passes[:1]
    one = ones[0]
    # the idle of every pass with one buffer at 1x, node by node: the median
    idle = {
        n: round(statistics.median(p["idle_cpu_per_s"][n] for p in ones), 4)
        for n in one["idle_cpu_per_s"]
    }

    def phase(kind: str) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """The K=1 pass's phase of `kind` and that pass's idle (the whole workload runs in a pass
        of its own: see run_bench)."""
        for p in ones:
            if kind in p["phases"]:
                return p["phases"][kind], p["idle_cpu_per_s"]
        return None, idle

    def cost_of(
        kind: str, name: str, ph: dict[str, Any], idle_of: dict[str, float]
    ) -> float | None:
        # the whole workload: the manager's load is its pushes, a buffer's its batches
        load = (
            load_of["status"](ph["achieved"])
            if kind == "all" and name == "manager"
            else load_of[kind](ph["achieved"])
        )
        above = max(0.0, ph["cpu_per_s"][name] - idle_of[name])
        return round(above / load, 4) if load > 0 else None

    def per_1x(kind: str, name: str) -> float | None:
        ph, idle_of = phase(kind)
        return None if ph is None else cost_of(kind, name, ph, idle_of)

    def every_pass(kind: str, name: str) -> list[float]:
        """The cost of `kind` in every pass with one buffer at 1x that ran it (the kinds' pass,
        and the shard rounds' K = 1 passes: their trajectory and chunk phases are the same)."""
        got = [
            cost_of(kind, name, p["phases"][kind], p["idle_cpu_per_s"])
            for p in ones
            if kind in p["phases"] and name in p["phases"][kind]["cpu_per_s"]
        ]
        return [v for v in got if v is not None]

    nodes = [n for n in idle]
    # a node's cost of 1x: the sum of its kinds' (each phase at 1x of its own kind, normalized by
    # what it delivered; each kind the median of the passes that ran it). The whole-workload
    # phase is the cross-check
    passes_by_kind = {n: {k: every_pass(k, n) for k in COST_PHASES if k != "all"} for n in nodes}
    by_kind = {
        n: {k: round(statistics.median(v), 4) if v else None for k, v in ks.items()}
        for n, ks in passes_by_kind.items()
    }
    out["cpu_core_s_per_1x_by_kind_passes"] = passes_by_kind
    # the kinds' pass alone (the only figure before the shard rounds ran K = 1 again)
    first = {n: {k: per_1x(k, n) for k in COST_PHASES if k != "all"} for n in nodes}
    out["cpu_core_s_per_1x_by_node_first_pass"] = {
        n: round(sum(v or 0.0 for v in ks.values()), 4) for n, ks in first.items()
    }
    by_node = {
        n: round(sum(v or 0.0 for v in ks.values()), 4)
        for n, ks in by_kind.items()
        if any(v is not None for v in ks.values())
    }
    out["cpu_core_s_per_1x_by_node"] = by_node
    out["cpu_core_s_per_1x_by_kind"] = by_kind
    out["cpu_core_s_per_1x_whole_phase_by_node"] = {n: per_1x("all", n) for n in nodes}
    out["idle_cpu_per_s_by_node"] = idle
    est = {n: round((1 - idle[n]) / v, 2) for n, v in by_node.items() if v}
    out["one_core_per_node_holds_x_by_node"] = est
    out["one_core_per_node_holds_x_estimate"] = min(est.values()) if est else None
    # handler CPU of the whole workload per kind (the accounting hook; receive, decode and reply
    # sends are outside it and in the phase figures)
    ph_all = phase("all")[0]
    if ph_all is not None:
        load = load_of["all"](ph_all["achieved"])
        hk: dict[str, dict[str, float]] = {}
        for n, per_type in ph_all["handler_cpu_per_s"].items():
            acc: dict[str, float] = {}
            for t, v in per_type.items():
                k = HANDLER_KINDS.get(t, "other")
                acc[k] = acc.get(k, 0.0) + v / load
            hk[n] = {k: round(v, 4) for k, v in acc.items()}
        out["handler_cpu_core_s_per_1x_by_kind"] = hk
    # the manager's per-status cost (the status phase) in us
    st, idle_st = phase("status")
    if st is not None and st["achieved"]["pushes"] > 0:
        out["manager_us_per_status"] = round(
            max(0.0, st["cpu_per_s"]["manager"] - idle_st["manager"])
            / st["achieved"]["pushes"]
            * 1e6,
            2,
        )
    out.update(shard_figures([p for p in passes if p.get("x", 1.0) == 1.0], rates))
    return out


def shard_figures(passes: list[dict[str, Any]], rates: dict[str, float]) -> dict[str, Any]:
    """Per buffer shard, from passes at K shards (rollout i -> i % K): its CPU above its idle per
    trajectory, from the kind phases (each normalized by what it delivered; a trajectory's own
    cost plus its partial stream's: batches per trajectory at 1x times the cost of a batch), what
    one wake-up of its reader served per phase (the per-message costs that do not divide: a
    shard that sees fewer messages gathers fewer per wake-up), and the spread of the K figures.
    Several passes at one K (rounds, --shard-rounds) give each shard the median of its rounds,
    each K the median of its rounds' means (..._rounds lists those means), and the spread is
    taken between those medians: one pass the box slowed moves no K."""
    rounds: dict[str, list[list[float]]] = {}
    h_rounds: dict[str, list[list[float]]] = {}
    wakeups: dict[str, dict[str, list[float | None]]] = {}
    per_traj_batches = rates["batches_s"] / rates["trajectories_s"]
    passes = [p for p in passes if "trajectory" in p["phases"] and "chunk" in p["phases"]]
    for p in passes:
        tr, ch = p["phases"]["trajectory"], p["phases"]["chunk"]
        k = p["buffer_shards"]
        t_s, b_s = tr["achieved"]["acked"] / k, ch["achieved"]["batches"] / k
        if t_s <= 0 or b_s <= 0:
            continue
        names = [n for n in p["idle_cpu_per_s"] if n.startswith("buffer")]
        rounds.setdefault(str(k), []).append(
            [
                (
                    max(0.0, tr["cpu_per_s"][n] - p["idle_cpu_per_s"][n]) / t_s
                    + max(0.0, ch["cpu_per_s"][n] - p["idle_cpu_per_s"][n]) / b_s * per_traj_batches
                )
                * 1e6
                for n in names
            ]
        )
        # the same per trajectory, counting only the thread CPU of the Trajectory and
        # PartialBatch handlers: the same calls on the same inputs at every K (a rollout's
        # batches all go to one shard, ~69 entries each), so where this moves with K the box
        # charges more CPU for the same work
        h_rounds.setdefault(str(k), []).append(
            [
                (
                    tr.get("handler_cpu_per_s", {}).get(n, {}).get("Trajectory", 0.0) / t_s
                    + ch.get("handler_cpu_per_s", {}).get(n, {}).get("PartialBatch", 0.0)
                    / b_s
                    * per_traj_batches
                )
                * 1e6
                for n in names
            ]
        )
        # what one wake-up served, from the first pass at each K
        wakeups.setdefault(
            str(k),
            {
                kind: [
                    (w or {}).get("messages_per_wakeup")
                    for n, w in ph.get("wakeups", {}).items()
                    if n.startswith("buffer")
                ]
                for kind, ph in p["phases"].items()
            },
        )

    def per_shard(by_k: dict[str, list[list[float]]]) -> dict[str, list[float]]:
        return {
            k: [round(statistics.median(col), 1) for col in zip(*rs, strict=True)]
            for k, rs in by_k.items()
        }

    def round_means(by_k: dict[str, list[list[float]]]) -> dict[str, list[float]]:
        return {k: [round(sum(r) / len(r), 1) for r in rs if r] for k, rs in by_k.items()}

    def spread(by_k: dict[str, list[list[float]]]) -> float | None:
        meds = [statistics.median(v) for v in round_means(by_k).values() if v]
        return round(max(meds) / min(meds) - 1, 3) if len(meds) > 1 and min(meds) > 0 else None

    return {
        "shard_cpu_us_per_trajectory_by_k": per_shard(rounds),
        "shard_cpu_us_per_trajectory_by_k_rounds": round_means(rounds),
        "shard_handler_cpu_us_per_trajectory_by_k": per_shard(h_rounds),
        "shard_handler_cpu_us_per_trajectory_by_k_rounds": round_means(h_rounds),
        "shard_handler_cpu_per_trajectory_spread": spread(h_rounds),
        "shard_messages_per_wakeup_by_k": wakeups,
        "shard_cpu_per_trajectory_spread": spread(rounds),
    }

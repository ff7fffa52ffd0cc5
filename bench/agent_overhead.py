"""The OpenAI-compatible endpoint's cost per turn, against the in-process Environment path.

    python bench/agent_overhead.py [--prompts 32] [--group 4] [--repeats 3] [--quick]
                                   [--out bench/results/agent_overhead.json]

Same episodes on the same engine, three ways (LocalCluster in this process, one sim rollout):

  env           an in-process Environment (FixedTurnsEnv) answers each model turn with the user
                message "continue", `turns` model turns per episode (laminar/rollout/episodes.py);
  agent         a black-box agent (fixed_turns_agent) in an agent worker process makes the same
                `turns` calls through the official openai client, adding the same user message
                each time (laminar/rollout/agents.py, agent_calls.py, openai_api.py,
                openai_shapes.py);
  agent_stream  the same agent with `stream=True` (fixed_turns_stream_agent): it joins the
                content deltas into the message it sends back (openai_stream.py).

The figure is the gap of each turn: from the engine finishing model turn k (the table sees
its final event) to turn k+1 entering the engine (engine.submit), per episode and turn. For
the env path it is the step and the observation's tokenization; for the agent path the HTTP
reply, the client's parsing, the agent's next call, the request's parsing, the message match,
tokenizing the new message and the submit; streamed, the last chunks, [DONE] and the client's
chunk parsing instead of the reply (the chunks sent while the engine decodes overlap decode
time). Printed as p50 / p90 / p99 per path (min/median/max over repeats) and the ratios
agent / env and agent_stream / agent; JSON to --out. The sim engine's decode time is not in
the gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from benchinfo import git_state  # noqa: E402

from laminar.envs.base import Environment, StepContext, StepResult  # noqa: E402

TURNS = int(os.environ.get("AGENT_BENCH_TURNS", "4"))


class FixedTurnsEnv(Environment):
    def reset(self, row: dict[str, Any], prompt: str) -> dict[str, int]:
        return {"turns": 0}

    async def step(self, state: dict[str, int], ctx: StepContext, model_text: str) -> StepResult:
        state["turns"] += 1
        if state["turns"] >= TURNS:
            return StepResult(done=True)
        return StepResult(observation="continue", role="user")

    async def score(self, state: dict[str, int], ctx: StepContext) -> float:
        return 0.5


async def fixed_turns_agent(row: dict[str, Any], client: Any) -> float:
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    for k in range(TURNS):
        resp = await client.chat.completions.create(model="m", messages=messages)
        messages.append(resp.choices[0].message)
        if k + 1 < TURNS:
            messages.append({"role": "user", "content": "continue"})
    return 0.5


async def fixed_turns_stream_agent(row: dict[str, Any], client: Any) -> float:
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    for k in range(TURNS):
        stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        messages.append({"role": "assistant", "content": "".join(parts)})
        if k + 1 < TURNS:
            messages.append({"role": "user", "content": "continue"})
    return 0.5


AGENTS = {"agent": "fixed_turns_agent", "agent_stream": "fixed_turns_stream_agent"}
PATHS = ("env", *AGENTS)
QUANTILES = {"p50": 50, "p90": 90, "p99": 99}


def make_cfg(tmp: Path, path: str, prompts: int, group: int) -> Any:
    from laminar.config import config_from_dict

    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"task {i}"}) + "\n" for i in range(prompts)))
    over: dict[str, Any] = (
        {"env": {"fn": "agent_overhead:FixedTurnsEnv", "limits": {"max_turns": TURNS + 1}}}
        if path == "env"
        else {"agent": {"fn": f"agent_overhead:{AGENTS[path]}", "workers": 2}}
    )
    return config_from_dict(
        {
            "name": f"agent-bench-{path}-{os.getpid()}",
            "run_dir": str(tmp / path),
            "cluster": {"transport": "inproc", "roles": {"manager": 1, "buffer": 1, "rollout": 0}},
            "data": {"train": str(data), "epochs": 1, "shuffle": False},
            "rollout": {
                "engine": "sim",
                "group_size": group,
                "credits": 4,
                "sampling": {"max_tokens": 4096},
                "sim": {"step_time_s": 0.005, "length_p50": 16, "length_p99_over_p50": 2.0},
            },
            "buffer": {"retry_after_s": 0.05},
            **over,
        }
    )


async def one_run(path: str, prompts: int, group: int) -> list[float]:
    from laminar.cluster import LocalCluster

    with tempfile.TemporaryDirectory() as d:
        cfg = make_cfg(Path(d), path, prompts, group)
        async with LocalCluster(cfg) as cluster:
            node = await cluster.add("rollout", 0)
            ended: dict[tuple[str, int], float] = {}
            gaps: list[float] = []
            on_event, submit = node.table.on_event, node.engine.submit

            def timed_event(ev: Any) -> Any:
                seq = on_event(ev)
                if seq is not None and ev.finished and ev.finish_reason == "stop":
                    ended[(seq.uid, seq.turn)] = time.perf_counter()
                return seq

            def timed_submit(req: Any) -> None:
                t_end = ended.pop((req.req_id, req.turn - 1), None)
                if req.turn > 0 and t_end is not None:
                    gaps.append(time.perf_counter() - t_end)
                submit(req)

            node.table.on_event, node.engine.submit = timed_event, timed_submit
            want = prompts * group
            end = time.monotonic() + 600
            while node.deliverer.finished_count < want:
                cluster.check()
                if time.monotonic() > end:
                    raise TimeoutError(f"{path}: {node.deliverer.finished_count}/{want} episodes")
                await asyncio.sleep(0.05)  # poll of a count, under a deadline
        return gaps


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_overhead.json"))
    ap.add_argument("--quick", action="store_true", help="8 prompts x 4 (a minute or two)")
    args = ap.parse_args()
    if args.quick:
        args.prompts = 8
    from laminar.logs import configure_logging

    configure_logging("warning", False)
    per: dict[str, dict[str, list[float]]] = {p: {q: [] for q in QUANTILES} for p in PATHS}
    turns_measured: dict[str, int] = {}
    for _ in range(args.repeats):
        for path in PATHS:
            gaps = asyncio.run(one_run(path, args.prompts, args.group))
            for q, pct in QUANTILES.items():
                per[path][q].append(float(np.percentile(gaps, pct)) * 1e3)
            turns_measured[path] = len(gaps)
    figures = {f"{path}_turn_gap_{q}_ms": stats(v) for path, d in per.items() for q, v in d.items()}

    def ratio(num: str, den: str) -> dict[str, dict[str, float]]:
        """Per quantile, num / den within each repeat (the same box load), over repeats."""
        return {
            q: stats([a / b for a, b in zip(per[num][q], per[den][q], strict=True)])
            for q in QUANTILES
        }

    out = {
        "bench": "agent_overhead",
        "config": {**vars(args), "turns": TURNS},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        **git_state(),
        "turns_measured_per_run": turns_measured,
        "figures": figures,
        "agent_over_env": ratio("agent", "env"),
        "stream_over_agent": ratio("agent_stream", "agent"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    head = "".join(f"{q + ' ms (min/med/max)':>26}" for q in QUANTILES)
    print(f"{'path':12} {head}")
    for path in PATHS:
        row = [figures[f"{path}_turn_gap_{q}_ms"] for q in QUANTILES]
        cells = "".join("{min:8.2f} {median:7.2f} {max:7.2f}".format(**r) for r in row)
        print(f"{path:12} {cells}")
    for name, key in (("agent/env", "agent_over_env"), ("stream/agent", "stream_over_agent")):
        print(f"{name}: " + ", ".join(f"{q} x{out[key][q]['median']:.2f}" for q in QUANTILES))
    print(f"({turns_measured} turn gaps per run) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

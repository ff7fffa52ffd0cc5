"""The tool demo: a tiny policy learns, with asynchronous multi-turn RL on CPU, to call a
calculator for the products it cannot compute.

    python -m laminar.demo.tooldemo [run_dir=runs/tool-demo] [key=value ...]

    tooluse task ─► train.jsonl / eval.jsonl                 (laminar/tasks/tooluse.py)
    demos: easy prompts answered, hard ones through the calculator 30% of the time and
    with the estimate habit otherwise ─► supervised warm-up on the whole transcripts, the
    tool responses masked out of the loss ─► policy v0 (cached in runs/.cache, reused)
    greedy episodes of v0 on the held-out prompts (ToolEnv + the calculator in process)
    laminar run configs/tool_demo.yaml   (manager, buffer, relay, trainer, tools node,
                                          2 torch rollouts: processes over ZeroMQ)
    the same episodes on every weight snapshot ─► accuracy and tool-call rate vs time and step
    report.png, summary.json, summary.md in the run directory

Overrides are the config's dotted keys (trainer.total_steps=40 ...) plus the demo's own
under demo (demo.warmup_steps=1500 ...; laminar.config.DemoConfig).

What RL has to learn: on hard prompts ("47*86=?") the warm-up model's greedy choice is
to answer its estimate (wrong), while sampling calls the calculator about a third of
the time and then answers right; GRPO on the verifier's reward makes the call the
greedy choice. Easy prompts ("47+6=?") it answers itself before and after.

The run keeps Laminar's multi-turn rules (laminar/rollout/episodes.py, laminar/envs/):
every model token of an episode comes from one weight version, the calculator's answer is
tokenized once by the turn template and trained with loss mask 0, and an episode moved or
lost mid-tool-call is rebuilt elsewhere by replay with its calls answered from the tools
node's cache. The held-out episodes here run outside the cluster (laminar/tasks/evaluate.py,
the calculator in process: direct_tools.py) with the same ToolEnv and turn template, greedy.

    .venv/bin/python -m pytest tests/test_tool_demo.py -q -m slow   # shortened, asserts the gain

The same task as a black-box OpenAI-client agent (laminar/demo/tooldemo/agent.py, the calculator
through `tools=`, trained through the rollouts' OpenAI-compatible endpoint); the held-out
episodes stay the in-process ToolEnv's, which the agent's calls render into token for token:

    python -m laminar.demo.tooldemo env.fn=null agent.fn=laminar.demo.tooldemo.agent:run \
        run_dir=runs/tool-demo-agent
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from laminar.config import DemoConfig, LaminarConfig, load_config

TOOL_DEMO_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tool_demo.yaml"
AGENT_TASK_ENV = "laminar.envs.tool_env:ToolEnv"
"""What held-out episodes run when the RL run trains an agent instead (agent.fn set, env.fn
null): the task's own environment, greedy, in process."""


def demo_settings(cfg: LaminarConfig) -> DemoConfig:
    """The config's demo section (configs/tool_demo.yaml sets the tool demo's values)."""
    return cfg.demo if cfg.demo is not None else DemoConfig()


def prepare_data(
    run_dir: Path, s: DemoConfig, seed: int
) -> tuple[Path, Path, list[dict], list[dict]]:
    from laminar.demo.__main__ import say
    from laminar.tasks import tooluse as tu

    hard = s.hard_share
    train = tu.generate(s.train_rows, "train", seed, hard_share=hard)
    ev = tu.generate(s.eval_rows, "eval", seed, hard_share=hard)
    tp = tu.write_jsonl(train, run_dir / "data" / "train.jsonl")
    ep = tu.write_jsonl(ev, run_dir / "data" / "eval.jsonl")
    n_hard = sum(r["kind"] == "hard" for r in ev)
    say(
        f"task tooluse: {len(train)} train / {len(ev)} held-out prompts ({n_hard} hard, "
        f"{len(ev) - n_hard} easy)"
    )
    return tp, ep, train, ev


def warm_up(s: DemoConfig, train: list[dict], seed: int) -> Path:
    from laminar.demo.__main__ import say
    from laminar.models.warmup import sft_warmup
    from laminar.tasks import tooluse as tu

    demos = tu.demonstrations(train, s.tool_rate, seed)
    pairs = [(r["prompt"], d) for r, d in zip(train, demos, strict=True)]
    out = Path(s.cache_dir) / f"tooluse-policy0-seed{seed}"
    t0 = time.time()
    say(
        f"warm-up: {s.warmup_steps} supervised steps on transcripts (tool responses masked); "
        f"hard prompts call the calculator in {s.tool_rate:.0%} of the demos; cached in {out}"
    )
    path = sft_warmup(
        out,
        pairs,
        tu.ALPHABET,
        model_kw=s.model.builder_kw(),
        steps=s.warmup_steps,
        batch_size=s.warmup_batch,
        lr=s.warmup_lr,
        schedule=s.warmup_schedule,
        seed=seed,
        log=say,
        log_every=250,
        token_norm="dataset",
    )
    say(f"warm-up policy ready at {path} ({time.time() - t0:.0f}s)")
    return path


def evaluate(
    model: Any, rows: list[dict], cfg: LaminarConfig, tokenizer: Any = None
) -> dict[str, Any]:
    """Greedy episodes of `model` (a path or a loaded model) on `rows`, as the run's env sees
    them."""
    from laminar.demo.tooldemo.direct_tools import DirectToolClient
    from laminar.envs.loader import load_env
    from laminar.tasks import tooluse as tu
    from laminar.tasks.base import Episodes
    from laminar.tasks.evaluate import evaluate_model

    env_cfg = cfg.env
    if env_cfg.fn is None and cfg.agent.fn:
        # the run trains an agent (agent.fn): held-out episodes are the same task's ToolEnv
        # episodes (laminar/demo/tooldemo/agent.py renders into exactly those tokens)
        env_cfg = env_cfg.model_copy(update={"fn": AGENT_TASK_ENV, "kwargs": {"tools": [tu.TOOL]}})
    env = load_env(env_cfg)
    if env is None:
        raise SystemExit(
            "the tool demo needs env.fn (configs/tool_demo.yaml: laminar.envs.tool_env:ToolEnv) "
            "or agent.fn (laminar.demo.tooldemo.agent:run)"
        )
    return evaluate_model(
        model,
        rows,
        tu.verify,
        episodes=Episodes(env, DirectToolClient(cfg.tools.tools), cfg.env.limits),
        max_tokens=cfg.rollout.sampling.max_tokens,
        tokenizer=tokenizer,
    )


def line(res: dict[str, Any]) -> str:
    hard, easy = res.get("hard", {}), res.get("easy", {})
    return (
        f"accuracy {res['accuracy']:.3f} (hard {hard.get('accuracy', float('nan')):.3f}, "
        f"easy {easy.get('accuracy', float('nan')):.3f}); tool-call rate on hard prompts "
        f"{hard.get('tool_rate', float('nan')):.2f}, on easy "
        f"{easy.get('tool_rate', float('nan')):.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(TOOL_DEMO_CONFIG, args)
    s = demo_settings(cfg)
    run_dir = cfg.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from laminar.demo.__main__ import Clock, run_mode, say
    from laminar.demo.tooldemo import results
    from laminar.logs import configure_logging
    from laminar.report import read_metrics

    configure_logging("warning", cfg.logging.json_logs)  # the nodes' logs go to the run's nodes.log

    clock = Clock()
    train_path, eval_path, train, ev = prepare_data(run_dir, s, cfg.seed)
    policy0 = Path(s.policy) if s.policy else warm_up(s, train, cfg.seed)
    clock.lap("warmup")
    before = evaluate(str(policy0), ev, cfg)
    say(f"warm-up model on {before['prompts']} held-out prompts: {line(before)}")
    clock.lap("eval_before")

    # trainer.eval_every=0: the demo evaluates weight snapshots after the run, not inside it
    common = [
        f"model.path={policy0}",
        f"data.train={train_path}",
        f"data.eval={eval_path}",
        "trainer.eval_every=0",
        *[a for a in args if not a.startswith(("run_dir=", "mode=", "name="))],
    ]
    run = run_mode(TOOL_DEMO_CONFIG, run_dir / cfg.mode, cfg.mode, common, s)
    clock.lap("rl")
    say("evaluating the weight snapshots")
    run["curve"] = results.eval_curve(
        Path(run["run_dir"]),
        policy0,
        ev,
        s,
        before,
        run["t0"],
        lambda model, rows, tok: evaluate(model, rows, cfg, tok),
        log=say,
    )
    run["metrics"] = read_metrics(Path(run["run_dir"]))
    clock.lap("eval_curve")
    summary = results.summarize(cfg.mode, run, before, time.time() - t_start)
    summary["phases"] = clock.phases
    results.write_outputs(run_dir, run, summary)
    say(
        f"held-out accuracy {summary['eval_accuracy_before']:.3f} -> "
        f"{summary['eval_accuracy_after']:.3f}, tool-call rate on hard prompts "
        f"{summary['hard_tool_rate_before']:.2f} -> {summary['hard_tool_rate_after']:.2f} "
        f"({summary['eval_prompts']} prompts); report at {run_dir}/summary.md"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

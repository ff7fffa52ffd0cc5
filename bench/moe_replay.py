"""Rollout routing replay (R3): the training-inference mismatch of a mixture-of-experts policy with
replay on and off, bf16 rollouts against an fp32 trainer (--rollout-dtype / --trainer-dtype change
either side).

    .venv/bin/python bench/moe_replay.py --quick --out /tmp/moe_replay.json    # ~1 min on 2 cores
    .venv/bin/python bench/moe_replay.py --out bench/results/moe_replay.json

Per seed: a tiny Qwen3-MoE policy built locally (models/tiny.py kind moe, random weights; 8
experts, top-2, every MLP routed), the torch engine in bfloat16 samples `groups` prompts x n
(temperature 1, routes recorded), and the trainer's packed forward in float32 (trainer/packed.py,
the same weights) scores every sampled token twice: routing live (replay off) and with the
rollout's routes forced (replay on, model.moe.routing_replay). Figures per token:
  lp_gap_mean / lp_gap_p99   |log pi_train - log pi_rollout| over the response tokens
  route_differs              share of routed positions (prompt + response but the last token)
                             whose top-k expert set differs from the rollout's in >= 1 layer
The ratio on/off is taken per seed, medians over seeds are reported. What is left with replay on
is the bf16 arithmetic itself (attention, norms, the experts' matmuls), not the routing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine import machine  # noqa: E402

from laminar.engines.base import GenRequest, SamplingParams  # noqa: E402
from laminar.engines.torch_engine import TorchEngine  # noqa: E402
from laminar.models.tiny import build_tiny_model, load_causal_lm  # noqa: E402
from laminar.protocol.data import PromptItem, Trajectory  # noqa: E402
from laminar.rollout.tracking import SeqState  # noqa: E402
from laminar.trainer.batch import TrainBatch  # noqa: E402
from laminar.trainer.packed import PackedForward, PackedLayout  # noqa: E402

SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, kind="moe", experts=8, experts_per_token=2)


async def _rollout(model: Any, prompts: list[np.ndarray], n: int, max_tokens: int, seed: int):
    eng = TorchEngine(model, None, max_running=64, max_model_len=256)
    await eng.start()
    trajs: list[Trajectory] = []
    try:
        for g, prompt in enumerate(prompts):
            item = PromptItem(f"p{g}", f"g{g}", prompt, n)
            seqs = {f"g{g}/{i}": SeqState.from_item(item, i, 0, 0.0) for i in range(n)}
            params = SamplingParams(max_tokens=max_tokens, seed=seed + g, ignore_eos=True)
            async for ev in eng.generate(GenRequest(f"g{g}", prompt, params, n=n), 300):
                s = seqs[ev.seq_id]
                s.append(ev.token_ids, ev.logprobs, 0.0)
                if ev.routes is not None:
                    s.add_routes(ev.route_start, ev.routes)
            for s in seqs.values():
                t = s.trajectory("length", "bench", 0.0)
                t.reward = 0.0
                trajs.append(t)
    finally:
        await eng.close()
    return trajs


def _sorted(r: torch.Tensor) -> torch.Tensor:
    return r.sort(-1).values


def _prompts(model: Path | None, groups: int, seed: int) -> list[np.ndarray]:
    """Random token ids for the random policy; held-out countup prompts (the demo's task, as the
    demo tokenizes them) for a trained one."""
    rng = np.random.default_rng(seed)
    if model is None:
        return [
            rng.integers(4, 40, size=int(rng.integers(6, 20))).astype(np.int32)
            for _ in range(groups)
        ]
    from laminar.models.prompt_tokenizer import load_prompt_tokenizer
    from laminar.tasks import countup

    tok = load_prompt_tokenizer(model, chat_template=False)
    rows = countup.generate(groups, "eval", seed)
    return [np.asarray(tok(r["prompt"])["input_ids"], np.int32) for r in rows]


def _touched(samples: list[Any], flips: np.ndarray) -> torch.Tensor:
    """Per trained token (PackedLayout.select's order): a flip reaches it, i.e. some position of
    its own sequence up to the one predicting it routes otherwise (attention reads every earlier
    position). The packed order (PackedLayout.build): each distinct prompt once, then every
    response."""
    prompt_at: dict[bytes, tuple[int, int]] = {}
    n_tok = 0
    for s in samples:
        if s.prompt_ids.tobytes() not in prompt_at:
            prompt_at[s.prompt_ids.tobytes()] = (n_tok, len(s.prompt_ids))
            n_tok += len(s.prompt_ids)
    out = []
    for s in samples:
        p_start, p_len = prompt_at[s.prompt_ids.tobytes()]
        r = len(s.response_ids)
        # token j is predicted at the prompt's last position (j = 0), else at response j - 1
        seen = np.cumsum(flips[n_tok : n_tok + r])[:-1] > 0
        hit = np.concatenate([[False], seen]) | bool(flips[p_start : p_start + p_len].any())
        out.append(hit if s.loss_mask is None else hit[s.loss_mask.astype(bool)])
        n_tok += r
    return torch.from_numpy(np.concatenate(out))


def _gaps(gap: torch.Tensor) -> dict[str, float]:
    if not len(gap):
        return {"mean": float("nan"), "p99": float("nan"), "tokens": 0}
    return {
        "mean": float(gap.mean()),
        "p99": float(torch.quantile(gap, 0.99)),
        "tokens": int(len(gap)),
    }


def measure(
    seed: int,
    groups: int,
    n: int,
    max_tokens: int,
    workdir: Path,
    model: Path | None = None,
    dtypes: tuple[str, str] = ("bfloat16", "float32"),
) -> dict[str, Any]:
    """One seed's figures; `dtypes`: (the rollout engine's, the trainer forward's)."""
    path = model or build_tiny_model(workdir / f"moe{seed}", seed=seed, **SHAPE)
    prompts = _prompts(model, groups, seed)
    t0 = time.perf_counter()
    engine = load_causal_lm(path, dtypes[0])
    trajs = asyncio.run(_rollout(engine, prompts, n, max_tokens, seed))
    rollout_s = time.perf_counter() - t0
    batch = TrainBatch.build(trajs)
    fwd = PackedForward(load_causal_lm(path, dtypes[1]))
    recorded = PackedLayout.build(batch.samples, moe=fwd.moe)
    assert recorded.routes is not None and recorded.routed is not None
    targets = torch.from_numpy(np.concatenate([s.response_ids for s in batch.samples]))
    behav = torch.from_numpy(np.concatenate([s.behav_logp for s in batch.samples])).double()
    out: dict[str, Any] = {"seed": seed, "tokens": int(len(targets)), "rollout_s": rollout_s}
    flipped = None  # response tokens predicted at a position whose live route (off) flipped
    touched = None  # response tokens predicted at or after a flipped position of their sequence
    for name, lay in (("off", PackedLayout.build(batch.samples)), ("on", recorded)):
        with torch.no_grad():
            logits = fwd(lay).double()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        gap = (lp - behav).abs()
        live = torch.stack(fwd.live_routes, 1)
        routed = recorded.routed
        per_pos = (_sorted(live) != _sorted(recorded.routes)).any(-1).any(-1) & routed
        if flipped is None:
            flipped = per_pos[lay.select]
            touched = _touched(batch.samples, per_pos.numpy())
        assert touched is not None
        out[name] = {
            # the tokens no flip reaches compute the same with replay on and off: their gap is
            # the bf16 arithmetic alone; the tokens a flip reaches carry the routing's share
            "untouched": _gaps(gap[~touched]),
            "touched": _gaps(gap[touched]),
            "lp_gap_mean": float(gap.mean()),
            "lp_gap_p99": float(torch.quantile(gap, 0.99)),
            "route_differs": float(per_pos[routed].double().mean()),
            "lp_gap_mean_at_flips": float(gap[flipped].mean()) if flipped.any() else float("nan"),
            "tokens_at_flips": int(flipped.sum()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a trained MoE policy (e.g. the MoE demo's warm-up, countup prompts) instead of "
        "random init; seeds then vary the prompts and the sampling",
    )
    ap.add_argument(
        "--rollout-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the engine's dtype (float32 with --trainer-dtype float32: the two sides differ only "
        "by kernels and batch shapes, so what replay leaves is no longer bf16 arithmetic)",
    )
    ap.add_argument("--trainer-dtype", default="float32", choices=("bfloat16", "float32"))
    a = ap.parse_args()
    dtypes = (a.rollout_dtype, a.trainer_dtype)
    torch.set_num_threads(2)
    groups, n, max_tokens = (8, 4, 32) if a.quick else (32, 8, 96)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            runs.append(measure(seed, groups, n, max_tokens, Path(tmp), a.model, dtypes))
    keys = ("lp_gap_mean", "lp_gap_p99", "route_differs", "lp_gap_mean_at_flips")
    summary: dict[str, Any] = {}
    head = f"{'figure':<22} {'replay off':>12} {'replay on':>12} {'on/off':>8}"
    print(f"{head}   (median of {a.seeds} seeds)")
    for k in keys:
        off = statistics.median(r["off"][k] for r in runs)
        on = statistics.median(r["on"][k] for r in runs)
        ratios = [r["on"][k] / r["off"][k] if r["off"][k] else float("nan") for r in runs]
        ratio = statistics.median(ratios)
        summary[k] = {
            "off": off,
            "on": on,
            "ratio_on_off": ratio,
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        print(f"{k:<22} {off:>12.5f} {on:>12.5f} {ratio:>8.3f}")
    # the decomposition: tokens no flip reaches (same computation on and off) and the rest
    for part in ("untouched", "touched"):
        for k in ("mean", "p99"):
            off = statistics.median(r["off"][part][k] for r in runs)
            on = statistics.median(r["on"][part][k] for r in runs)
            summary[f"{part}_{k}"] = {"off": off, "on": on, "ratio_on_off": on / off}
            print(f"{part + '_' + k:<22} {off:>12.5f} {on:>12.5f} {on / off:>8.3f}")
    share = statistics.median(r["on"]["touched"]["tokens"] / r["tokens"] for r in runs)
    summary["touched_share"] = share
    print(f"{'touched_share':<22} {share:>12.4f}   (response tokens a flip reaches, replay off)")
    result = {
        "bench": "moe_replay",
        "config": {
            "model": str(a.model) if a.model else "random init",
            "shape": SHAPE if a.model is None else None,
            "groups": groups,
            "n": n,
            "max_tokens": max_tokens,
            "seeds": a.seeds,
            "rollout_dtype": a.rollout_dtype,
            "trainer_dtype": a.trainer_dtype,
            "temperature": 1.0,
        },
        "machine": machine(),
        "summary": summary,
        "runs": runs,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

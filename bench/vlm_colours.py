"""A vision-language policy learning with `laminar run` on CPU: the colours task
(laminar/tasks/colours.py), where the answer is only in the image.

    python bench/vlm_colours.py --seeds 0 1 2 --steps 150 --warmup 600 --lr 1e-3 \
        --batch-groups 8 --group-size 8 --train 400 --eval 80 --freeze-vision

Per seed:
  1. a tiny Qwen2-VL with random weights (laminar/models/tiny_vlm.py), then a supervised
     warm-up that never shows a task colour's true label (`warm_up`): images of four *other*
     colours with their names (the LM learns to read a colour off the image tokens, as a
     pretrained VLM can) and the task's images each with a random task colour (the answer
     format only), learning rate decayed to 0. Held-out accuracy after it is at or under
     chance; a text model can do no better than 1/4 on this task (the prompt is the same text
     for every row and the colours are balanced);
  2. `laminar run` (real processes: buffer, rollout with the VLM engine, trainer, relay,
     manager; images once per group, fetched by digest by the trainer) for --steps steps;
  3. held-out accuracy (greedy, the VLM engine) before and after, on --eval prompts.

Prints a table and writes JSON: per seed before / after / gain, the batch reward over the first
and last tenth of the RL steps, the medians, and the text ceiling (the most frequent colour's
share of the held-out set: 0.25, the splits are balanced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine import machine  # noqa: E402


def warm_up(path: Path, seed: int, steps: int, base: Path, lr: float = 3e-3) -> None:
    """Supervised warm-up that never gives a task colour's true label, each batch half and half:
    - the task's training images, each with a colour drawn at random (not its own): the answer
      format "#<colour>" over the task's four colours, with no reason to read the image;
    - images of four other colours (colours.WARMUP_COLOURS: orange, purple, cyan, black), each
      with its own name: the LM learns to read a colour off the image tokens, as a pretrained
      VLM can, but the task's four colours are not among them.
    The learning rate decays linearly to 0, so the last batches' random labels do not leave the
    policy leaning to one colour (RL from a policy that always says "#red" never sees a group
    with mixed rewards)."""
    import torch

    from laminar.data.prompts import load_prompts
    from laminar.data.vision_prompts import VisionEncoder
    from laminar.models.tiny_vlm import load_processor, load_vlm
    from laminar.tasks import colours
    from laminar.vision.pixels import pixel_inputs

    proc = load_processor(path)
    model = load_vlm(path).train()
    prompts, _ = load_prompts(base / "train.jsonl")
    enc = VisionEncoder(proc, 128)
    rng = random.Random(seed)
    names = sorted(colours.COLOURS)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / steps)
    tok = proc.tokenizer
    encoded = [(enc.encode(r.prompt, r.images)[0], r.images[0].data) for r in prompts]
    prompt_ids = encoded[0][0]  # the same text for every row: "colour?" + one image
    others = sorted(colours.WARMUP_COLOURS)
    draw_rng = random.Random(f"warmup/{seed}")
    aux = [(c, colours.draw(draw_rng, c)) for c in others for _ in range(len(encoded) // 4)]
    for _ in range(steps):
        batch = [(p, png, rng.choice(names)) for p, png in rng.sample(encoded, 8)]
        batch += [(prompt_ids, png, c) for c, png in rng.sample(aux, 8)]
        ids, labels, pngs = [], [], []
        for prompt, png, colour in batch:
            answer = tok(colours.solve(colour), add_special_tokens=False)["input_ids"]
            full = list(prompt) + answer + [tok.eos_token_id]
            ids.append(full)
            labels.append([-100] * len(prompt) + answer + [tok.eos_token_id])
            pngs.append(png)
        width = max(len(x) for x in ids)
        x = torch.tensor([a + [tok.pad_token_id] * (width - len(a)) for a in ids])
        y = torch.tensor([a + [-100] * (width - len(a)) for a in labels])
        att = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in ids])
        px = pixel_inputs(proc, pngs)
        out = model(
            input_ids=x,
            attention_mask=att,
            labels=y,
            pixel_values=px.pixel_values,
            image_grid_thw=px.grid_thw,
            mm_token_type_ids=(x == proc.image_token_id).long(),
        )
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        decay.step()
    model.eval().save_pretrained(path, safe_serialization=True)


def accuracy(path: Path, eval_file: Path) -> float:
    """Greedy held-out accuracy with the VLM engine."""
    from laminar.data.prompts import load_prompts
    from laminar.data.vision_prompts import VisionEncoder
    from laminar.engines.base import GenRequest, SamplingParams
    from laminar.engines.vlm_engine import VlmEngine
    from laminar.models.tiny_vlm import load_processor, load_vlm
    from laminar.tasks import colours

    proc = load_processor(path)
    rows, _ = load_prompts(eval_file)
    enc = VisionEncoder(proc, 128)
    params = SamplingParams(temperature=0.0, max_tokens=8)

    async def go() -> float:
        engine = VlmEngine(load_vlm(path), proc)
        await engine.start()
        right = 0
        try:
            for k, r in enumerate(rows):
                ids, _ = enc.encode(r.prompt, r.images)
                req = GenRequest(f"e{k}", ids, params, images=tuple(i.data for i in r.images))
                toks, _, _ = (await engine.generate_all(req, timeout=60))[f"e{k}/0"]
                text = proc.tokenizer.decode(toks, skip_special_tokens=True)
                right += colours.verify(text, r.row["answer"]) > 0
        finally:
            await engine.close()
        return right / len(rows)

    return asyncio.run(go())


CONFIG = """name: vlm-colours-{seed}
mode: laminar
seed: {seed}
cluster: {{transport: ipc, roles: {{manager: 1, buffer: 1, relay: 1, trainer: 1, rollout: 1}},
  threads_per_process: 1}}
transport: {{heartbeat_interval_s: 0.5, heartbeat_liveness: 10, startup_timeout_s: 120}}
model: {{path: {model}, dtype: float32, device: cpu, freeze_vision: {freeze}}}
data: {{train: {train}, max_prompt_tokens: 64, seed: {seed}}}
reward: {{fn: "laminar.tasks.colours:reward", workers: 0, timeout_s: 5}}
rollout:
  engine: torch
  group_size: {group_size}
  max_running: 32
  credits: 2
  max_model_len: 128
  sampling: {{temperature: 1.0, top_p: 1.0, max_tokens: 8}}
trainer: {{engine: torch, lr: {lr}, total_steps: {steps}, batch_groups: {batch_groups},
  micro_batch_tokens: 2048, checkpoint_every: 0}}
buffer: {{capacity: 256, max_staleness: 2, fsync: never}}
algo: {{entropy_coef: {entropy_coef}}}
"""


def one_seed(seed: int, args: argparse.Namespace, work: Path) -> dict:
    from laminar.models.tiny_vlm import build_tiny_vlm
    from laminar.tasks import colours
    from laminar.trainer import checkpoint as ck

    base = work / f"seed{seed}"
    data = colours.write_splits(base / "data", args.train, args.eval, seed=seed)
    model = build_tiny_vlm(base / "policy", seed=seed, hidden=64, layers=2)
    t0 = time.time()
    warm_up(model, seed, args.warmup, base / "data")
    before = accuracy(model, data["eval"])
    cfg = base / "run.yaml"
    cfg.write_text(
        CONFIG.format(
            seed=seed,
            model=model,
            train=data["train"],
            lr=args.lr,
            steps=args.steps,
            freeze=str(args.freeze_vision).lower(),
            group_size=args.group_size,
            batch_groups=args.batch_groups,
            entropy_coef=args.entropy_coef,
        )
    )
    run_dir = base / "run"
    t1 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "laminar", "run", str(cfg), f"run_dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"laminar run failed (seed {seed}):\n{proc.stdout[-3000:]}")
    run_s = time.time() - t1
    final = ck.latest_checkpoint(run_dir)
    assert final is not None, "no final checkpoint"
    after = accuracy(final / "model", data["eval"])
    answers = Counter(json.loads(line)["answer"] for line in data["eval"].read_text().splitlines())
    rewards = [
        json.loads(line)["reward"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"reward"' in line
    ]
    k = max(1, len(rewards) // 10)
    return {
        "seed": seed,
        "before": before,
        "after": after,
        "gain": after - before,
        "text_ceiling": max(answers.values()) / sum(answers.values()),
        "batch_reward_first_10pct": statistics.fmean(rewards[:k]) if rewards else None,
        "batch_reward_last_10pct": statistics.fmean(rewards[-k:]) if rewards else None,
        "run_s": run_s,
        "total_s": time.time() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=60, help="format warm-up steps (batch 16)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=4, help="groups per trainer step")
    ap.add_argument("--entropy-coef", type=float, default=0.0, help="algo.entropy_coef")
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument(
        "--freeze-vision",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="model.freeze_vision (the tiny tower is random: by default it trains too)",
    )
    ap.add_argument("--work", default="/tmp/laminar-bench-vlm")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vlm_colours.json"))
    args = ap.parse_args()
    work = Path(args.work)
    results = [one_seed(s, args, work) for s in args.seeds]
    med = {
        k: statistics.median(r[k] for r in results)
        for k in ("before", "after", "gain", "text_ceiling")
    }
    print(
        f"{'seed':>4} {'before':>7} {'after':>7} {'gain':>7} {'text':>6} "
        f"{'r first':>7} {'r last':>7} {'run s':>7}"
    )
    for r in results:
        print(
            f"{r['seed']:>4} {r['before']:7.3f} {r['after']:7.3f} {r['gain']:+7.3f} "
            f"{r['text_ceiling']:6.2f} {r['batch_reward_first_10pct'] or 0:7.3f} "
            f"{r['batch_reward_last_10pct'] or 0:7.3f} {r['run_s']:7.1f}"
        )
    print(
        f"median {med['before']:5.3f} {med['after']:7.3f} {med['gain']:+7.3f} "
        f"{med['text_ceiling']:6.2f}"
    )
    out = {
        "bench": "vlm_colours",
        "config": vars(args),
        "machine": machine(),
        "seeds": results,
        "median": med,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

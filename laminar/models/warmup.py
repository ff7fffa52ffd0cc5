"""Supervised warm-up of a tiny policy on (prompt, completion) demonstrations.

    pairs = [(prompt, demo) for ...]                     # deliberately imperfect demos
    path = sft_warmup("runs/demo/policy0", pairs, alphabet=ALPHABET, steps=600)

The loss covers completion tokens only (prompt tokens are context), the
completion ends with EOS so the model learns to stop. The result is a normal HF
directory (config.json, model.safetensors, tokenizer.json) that the trainer and
the rollouts load like any other model; a `warmup.json` beside it records what
was trained so a later run reuses it when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from laminar.models.tiny import char_tokenizer, tiny_config


def _fingerprint(pairs: Sequence[tuple[str, str]], meta: dict[str, Any]) -> str:
    h = hashlib.blake2b(json.dumps(meta, sort_keys=True).encode(), digest_size=16)
    for p, c in pairs:
        h.update(p.encode())
        h.update(b"\0")
        h.update(c.encode())
        h.update(b"\1")
    return h.hexdigest()


def encode_pair(tok, prompt: str, completion: str) -> tuple[list[int], int]:
    """Token ids of BOS + prompt + completion + EOS, and the index where the completion starts."""
    p = [tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]
    c = [*tok(completion, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    return p + c, len(p)


def sft_warmup(
    out_dir: str | Path,
    pairs: Sequence[tuple[str, str]],
    alphabet: str,
    model_kw: dict[str, Any] | None = None,
    steps: int = 600,
    batch_size: int = 32,
    lr: float = 3e-3,
    warmup_steps: int = 30,
    seed: int = 0,
    time_budget_s: float | None = None,
    log_every: int = 50,
    log=print,
) -> Path:
    """Train a fresh tiny model on the pairs (reused if `out_dir` holds the same run)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    model_kw = dict(model_kw or {})
    meta = {"alphabet": alphabet, "model": model_kw, "steps": steps, "batch": batch_size, "lr": lr, "seed": seed}
    fp = _fingerprint(pairs, meta)
    stamp = out / "warmup.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == fp:
        log(f"warmup: reusing {out}")
        return out

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = char_tokenizer(alphabet)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tok), **model_kw), dtype=torch.float32)
    model.train()
    data = [encode_pair(tok, p, c) for p, c in pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t0 = time.time()
    losses: list[float] = []
    step = 0
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (seq, start) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, start : len(seq)] = torch.tensor(seq[start:])
            mask[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
        if log_every and (step + 1) % log_every == 0:
            log(f"warmup: step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.4f} ({time.time() - t0:.0f}s)")
        if time_budget_s is not None and time.time() - t0 > time_budget_s:
            log(f"warmup: time budget {time_budget_s:.0f}s reached at step {step + 1}")
            break
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    stamp.write_text(json.dumps({"fingerprint": fp, "steps_done": step + 1, "final_loss": losses[-1] if losses else None,
                                 "seconds": round(time.time() - t0, 1), **meta}))  # fmt: skip
    return out

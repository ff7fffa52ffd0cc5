"""Sparse weight deltas on a real optimizer step: changed fraction, bytes on the wire, broadcast
time.

    .venv/bin/python bench/weights.py --delta --quick --out /tmp/wd.json   # ~3 min on 2 cores
    .venv/bin/python bench/weights.py --delta --out bench/results/weights_delta.json

1. Model: a ~106M-parameter decoder built here from torch.nn (embedding 32000x768, 8
   pre-norm TransformerEncoderLayers d=768 ff=3072 with a causal mask, untied LM head),
   random init, nothing downloaded. Trained the way laminar's trainer does it (torch_trainer.py):
   **fp32 master weights** + AdamW (betas 0.9/0.999, weight decay 0.01), and each version is
   the bf16 copy of the master that the trainer exports and the relays broadcast. So a bf16
   element changes only when the fp32 master crossed a bf16 rounding boundary. (With
   `--pure-bf16` the parameters themselves are bf16 and every update rounds in bf16: far
   fewer changes, an optimistic bound nobody trains with.) Loss: next-token cross-entropy
   on random tokens (dense gradients everywhere except the embedding rows of tokens not in
   the batch, which AdamW leaves alone but for weight decay, as in RL).
   Each lr (1e-6, 1e-5) starts from the same init, takes `--warmup` steps (Adam's first
   step moves every weight by exactly lr), then `--steps` measured steps.
2. Per measured step: the fraction of bf16 elements whose bits changed (uint16 compare),
   and the bytes a version costs on each link: the relay codec run on the real chunking
   (4 MiB chunks, per chunk indices / bitmask / whole, laminar/weights/delta.py)
   divided by the full bf16 size.
3. Broadcast: the versions pushed through a chain of `--relays` real relay processes on
   link-emulated hops (`--link-MBps`, relay.link_bytes_per_s), delta mode off and on:
   commit -> last relay has the version, and the bytes the relays counted as received.
   The master encodes every chunk (one core, numpy) before serving it, and the chain is
   pipelined, so delta broadcast ≈ max(M / encode rate, delta bytes / link) against
   M / link for full weights: delta mode wins on links slower than `encode_GBps` (10 GbE
   and below on these CPUs) and can lose on faster ones; that is why relay.delta is a knob.

Published reference: in bf16 RL fine-tuning more than 98% of the weights are bit-identical
from one step to the next (a 1T-parameter FP8 checkpoint averaged a ~2% delta per step).
Summary keys: delta_bytes_frac_lr1e-6 / _lr1e-5 (bytes per version / full bf16 size),
changed_frac_lr1e-6 / _lr1e-5, bcast_delta_vs_full_lr1e-6 / _lr1e-5 (time ratio),
encode_GBps_* (the master's encode throughput), wire_bytes_frac_measured_* (counted by the
last relay; equals the codec's figure when every hop forwards the master's deltas).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/ harness

from laminar.logs import configure_logging  # noqa: E402
from laminar.weights.delta import chunk_words, delta_header, encode_delta  # noqa: E402
from laminar.weights.layout import chunk_range, layout_of, n_chunks, tensor_spans  # noqa: E402
from tests.relay_procs import RelayProcs  # noqa: E402

LRS = {1e-6: "lr1e-6", 1e-5: "lr1e-5"}  # lr -> its name in the summary keys
CHUNK = 4 << 20


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32000, d: int = 768, layers: int = 8, heads: int = 12):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():  # small-scale init, as an LLM's weights are (|w| ~ 0.02)
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.norm(self.body(self.emb(tokens), mask=mask, is_causal=True)))


def bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def train_versions(lr: float, args, seed: int, log) -> tuple[list[dict[str, torch.Tensor]], float]:
    """bf16 versions: [after warm-up, after each measured step]; and the mean step time."""
    torch.manual_seed(seed)
    model = TinyLM()
    if args.pure_bf16:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    versions, times = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        tok = torch.randint(0, 32000, (args.batch, args.seq + 1), generator=g)
        logits = model(tok[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.float().reshape(-1, 32000), tok[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if step >= args.warmup - 1:
            versions.append(
                bf16_state(model)
                if not args.pure_bf16
                else {k: v.detach().clone() for k, v in model.state_dict().items()}
            )
        log(f"  lr {lr:g} step {step}: loss {loss.item():.4f} ({times[-1]:.1f}s)")
    return versions, statistics.mean(times)


def flat(state: dict[str, torch.Tensor]) -> np.ndarray:
    """The relay's flat buffer of a version (aligned tensors, zero padding)."""
    layout = layout_of(list(state.items()))
    buf = np.zeros(layout.total_bytes, dtype=np.uint8)
    for (_name, _dt, _shape, off, nb), t in zip(tensor_spans(layout), state.values(), strict=True):
        buf[off : off + nb] = t.contiguous().view(-1).view(torch.uint8).numpy()
    return buf


def wire_cost(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """What one version costs each link with the relay codec, chunk by chunk."""
    layout = layout_of(list(new.items()))
    a, b = flat(prev), flat(new)
    words = chunk_words(layout, CHUNK)
    total = layout.total_bytes
    sent, encs, encode_s = 0, {"indices": 0, "bitmask": 0, "full": 0}, 0.0
    for i in range(n_chunks(total, CHUNK)):
        s, e = chunk_range(i, CHUNK, total)
        t0 = time.perf_counter()
        blob = encode_delta(b[s:e], a[s:e], int(words[i]))
        encode_s += time.perf_counter() - t0
        if blob is None:
            sent += e - s
            encs["full"] += 1
        else:
            sent += len(blob)
            encs["indices" if delta_header(blob)[0] == 1 else "bitmask"] += 1
    n_el = changed = 0
    for k, t in new.items():
        if t.dtype != torch.bfloat16:
            continue
        x, y = prev[k].view(torch.int16), t.view(torch.int16)
        n_el += t.numel()
        changed += int((x != y).sum())
    return {
        "bytes": sent,
        "full_bytes": total,
        "bytes_frac": sent / total,
        "encode_s": encode_s,
        "changed_frac": changed / max(1, n_el),
        "chunks": encs,
    }


async def push_and_wait(procs: RelayProcs, pusher, pullers, version: int, state: dict) -> tuple:
    """One push; returns (commit -> every relay announced it, bytes the last relay received)."""
    last = procs.n - 1
    before = (await procs.info(last, timeout=5)).counters.get("bytes_received", 0)
    await pusher.push(version, state)
    t0 = time.perf_counter()
    for q in pullers:
        await q.wait_version(version, timeout=300)
    dt = time.perf_counter() - t0
    after = (await procs.info(last, timeout=5)).counters.get("bytes_received", 0)
    return dt, after - before


async def broadcast(root: Path, all_versions: dict[float, list], args, log) -> dict:
    """Push every lr's versions through a real relay chain, delta off and on."""
    out: dict = {}
    for delta in (False, True):
        ov = {
            "relay.chunk_bytes": CHUNK,
            "relay.delta": delta,
            "relay.max_slots": 3,
            "relay.spare_slots": 1,
            "relay.link_bytes_per_s": args.link_MBps * 1e6,
            "transport.heartbeat_interval_s": 0.5,
            "transport.heartbeat_liveness": 8,
            "transport.request_timeout_s": 60.0,
            "relay.probe_timeout_s": 3.0,
            "logging.level": "warning",
        }
        procs = RelayProcs(root / f"d{int(delta)}", args.relays, ov).start()
        pullers = [procs.puller(f"rollout-{i}", relay_index=i) for i in range(args.relays)]
        try:
            await procs.wait_ready(60)
            await procs.wait_chain(timeout=60)
            pusher = procs.pusher("trainer-0")
            await pusher.start()
            for q in pullers:
                await q.start()
            push = partial(push_and_wait, procs, pusher, pullers)
            first = next(iter(all_versions.values()))[0]
            for version in (1, 2, 3):  # warm-up: every relay's slots created and mapped
                await push(version, first)
            version = 3
            for lr, versions in all_versions.items():
                times, wire = [], []
                for j, state in enumerate(versions):
                    version += 1
                    dt, nbytes = await push(version, state)
                    if j > 0:  # the first version of an lr follows another run's: not measured
                        times.append(dt)
                        wire.append(nbytes)
                key = LRS[lr]
                out.setdefault(key, {})["delta_s" if delta else "full_s"] = times
                out[key]["wire_bytes_delta" if delta else "wire_bytes_full"] = wire
                log(
                    f"  broadcast lr {lr:g} delta={delta}: {statistics.median(times):.3f}s, "
                    f"{statistics.median(wire) / 1e6:.1f} MB into the last relay"
                )
            await pusher.close()
        finally:
            for q in pullers:
                await q.close()
            await procs.close_clients()
            procs.stop()
    return out


def run(args, log) -> dict:
    """The whole benchmark; returns {"summary": ..., "results": ...}."""
    results: dict = {"lrs": {}}
    versions: dict[float, list] = {}
    for lr in LRS:
        vs, step_s = train_versions(lr, args, seed=0, log=log)
        costs = [wire_cost(a, b) for a, b in zip(vs, vs[1:], strict=False)]
        n_params = sum(t.numel() for t in vs[0].values())
        results["lrs"][LRS[lr]] = {"step_s": step_s, "params": n_params, "steps": costs}
        log(
            f"  lr {lr:g}: changed {[round(c['changed_frac'], 4) for c in costs]}, "
            f"bytes/full {[round(c['bytes_frac'], 4) for c in costs]}"
        )
        versions[lr] = vs
    root = Path(tempfile.mkdtemp(prefix="lam-wdelta-", dir="/tmp"))
    try:
        results["broadcast"] = asyncio.run(broadcast(root, versions, args, log))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict = {
        "params": results["lrs"]["lr1e-6"]["params"],
        "fp32_master": not args.pure_bf16,
        "published_changed_frac": 0.02,
    }
    for key in LRS.values():
        costs = results["lrs"][key]["steps"]
        b = results["broadcast"][key]
        summary[f"delta_bytes_frac_{key}"] = statistics.mean(c["bytes_frac"] for c in costs)
        summary[f"changed_frac_{key}"] = statistics.mean(c["changed_frac"] for c in costs)
        # the master's extra pass (one core): the chain is pipelined, so delta mode wins on
        # links slower than this and loses on faster ones
        summary[f"encode_GBps_{key}"] = statistics.median(
            c["full_bytes"] / c["encode_s"] / 1e9 for c in costs
        )
        summary[f"wire_bytes_frac_measured_{key}"] = statistics.median(
            b["wire_bytes_delta"]
        ) / statistics.median(b["wire_bytes_full"])
        summary[f"bcast_full_s_{key}"] = statistics.median(b["full_s"])
        summary[f"bcast_delta_s_{key}"] = statistics.median(b["delta_s"])
        summary[f"bcast_delta_vs_full_{key}"] = (
            summary[f"bcast_delta_s_{key}"] / summary[f"bcast_full_s_{key}"]
        )
    return {"summary": summary, "results": results}


def main(argv: list[str] | None, quick: bool, out: str, common: dict) -> int:
    """bench/weights.py --delta dispatches here (its --quick and --out are passed through)."""
    import argparse

    ap = argparse.ArgumentParser(description="bench/weights.py --delta: sparse weight deltas")
    ap.add_argument("--steps", type=int, default=2 if quick else 5, help="measured steps per lr")
    ap.add_argument("--warmup", type=int, default=1 if quick else 3, help="unmeasured first steps")
    ap.add_argument("--batch", type=int, default=1 if quick else 2)
    ap.add_argument("--seq", type=int, default=32 if quick else 64)
    ap.add_argument("--relays", type=int, default=3, help="relays in the chain (hops + 1)")
    ap.add_argument(
        "--link-MBps",
        type=float,
        default=100.0,
        help="emulated link per hop (100 MB/s: a 1 Gb/s-class host link)",
    )
    ap.add_argument(
        "--pure-bf16",
        action="store_true",
        help="bf16 parameters and optimizer (no fp32 master): updates round in bf16",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    configure_logging("warning")  # the pushers and pullers of this process
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    doc = run(args, log)
    doc = {
        "bench": "weights_delta",
        "config": {**vars(args), "quick": quick, "chunk_bytes": CHUNK},
        **common,
        "elapsed_s": time.time() - t_start,
        **doc,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2))
    print()
    for k, v in doc["summary"].items():
        print(f"{k:>36}: {v:.4f}" if isinstance(v, float) else f"{k:>36}: {v}")
    print(f"wrote {out} in {time.time() - t_start:.0f}s")
    return 0

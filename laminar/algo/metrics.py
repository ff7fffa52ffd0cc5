"""Reducible loss/batch statistics: tensor partials (sum, count, max, min) that merge over
micro-batches and ranks, then one `finalize()` that turns them into the logged numbers.

    acc = StatAccumulator()
    acc.add("is/w", w, mask)                    # masked tensor values -> one Partial
    acc.add_value("grad_norm", 0.7)
    acc.merge(other_micro_batch_acc)          # or acc.all_reduce() across FSDP ranks
    acc.finalize()                            # {"is/w_mean": .., "is/w_max": .., "is/ess": .., ...}

NaN-safe: non-finite values are skipped and counted under `nonfinite/<name>`; a metric
with no samples is NaN (the logger writes it as null) rather than a fake 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import torch

from laminar.metrics import Partial

# metrics whose logged form is only the mean (the rest also log max)
_MEAN_ONLY_PREFIXES = ("frac/",)


class StatAccumulator:
    def __init__(self) -> None:
        self.parts: dict[str, Partial] = {}

    def _part(self, name: str) -> Partial:
        part = self.parts.get(name)
        if part is None:
            part = self.parts[name] = Partial()
        return part

    @torch.no_grad()
    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add the masked elements of `values` (any shape); non-finite ones are skipped and
        counted."""
        v = values.detach().to(torch.float64)
        sel = (
            torch.ones_like(v, dtype=torch.bool)
            if mask is None
            else mask.to(torch.bool).expand_as(v)
        )
        finite = torch.isfinite(v)
        bad = int((sel & ~finite).sum())
        if bad:
            self._part(f"nonfinite/{name}").merge(Partial(float(bad), 1, float(bad), float(bad)))
        sel = sel & finite
        n = int(sel.sum())
        part = self._part(name)
        if n == 0:
            return
        x = v[sel]
        part.merge(Partial(float(x.sum()), n, float(x.max()), float(x.min())))

    def add_value(self, name: str, value: float, weight: int = 1) -> None:
        self._part(name).add(value, weight)

    def merge(self, other: StatAccumulator) -> None:
        for name, part in other.parts.items():
            self._part(name).merge(part)

    def all_reduce(self, group=None) -> None:
        """Reduce every partial over torch.distributed ranks (all ranks must hold the same
        names)."""
        import torch.distributed as dist

        names = sorted(self.parts)
        sums = torch.tensor(
            [[self.parts[n].sum, self.parts[n].count] for n in names], dtype=torch.float64
        )
        maxs = torch.tensor([self.parts[n].max for n in names], dtype=torch.float64)
        mins = torch.tensor([self.parts[n].min for n in names], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
        for i, n in enumerate(names):
            self.parts[n] = Partial(
                float(sums[i, 0]), int(sums[i, 1]), float(maxs[i]), float(mins[i])
            )

    def mean(self, name: str) -> float:
        part = self.parts.get(name)
        return part.mean if part is not None else math.nan

    def finalize(self) -> dict[str, float]:
        """Logged numbers: <name> (mean) and <name>_max for every partial, plus derived figures."""
        out: dict[str, float] = {}
        for name, part in sorted(self.parts.items()):
            if name.startswith("nonfinite/"):
                out[name] = part.sum
                continue
            if name.startswith("sum/"):
                out[name[4:]] = part.sum if part.count else math.nan
                continue
            out[name] = part.mean
            if not name.startswith(_MEAN_ONLY_PREFIXES):
                out[f"{name}_max"] = part.max if part.count else math.nan
        w, w2 = self.parts.get("is/w"), self.parts.get("is/w_sq")
        if w is not None and w2 is not None:
            out["is/ess"] = ess_from_sums(w.sum, w2.sum, w.count)
            out.pop("is/w_sq", None)
            out.pop("is/w_sq_max", None)
        return out


def ess_from_sums(sum_w: float, sum_w2: float, n: int) -> float:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1]; NaN without samples."""
    if n == 0 or not sum_w2 > 0:
        return math.nan
    return (sum_w * sum_w) / (n * sum_w2)


def normalized_ess(w: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """ESS of the (masked) weights, normalised by their count: 1 = all equal, 1/n = one
    dominates."""
    x = w.detach().to(torch.float64)
    if mask is not None:
        x = x[mask.to(torch.bool)]
    x = x[torch.isfinite(x)]
    return ess_from_sums(float(x.sum()), float((x * x).sum()), x.numel())


def staleness_histogram(staleness: Iterable[int]) -> dict[str, int]:
    """{"staleness_hist/0": n0, "staleness_hist/1": n1, ...} (keys sorted by staleness)."""
    counts = Counter(int(s) for s in staleness)
    return {f"staleness_hist/{k}": counts[k] for k in sorted(counts)}


def length_stats(lengths: Iterable[int], prefix: str = "response_len") -> dict[str, float]:
    """mean / min / max / p50 / p90 of response lengths."""
    xs = sorted(int(x) for x in lengths)
    if not xs:
        return {f"{prefix}/mean": math.nan}
    n = len(xs)
    return {
        f"{prefix}/mean": sum(xs) / n,
        f"{prefix}/min": float(xs[0]),
        f"{prefix}/max": float(xs[-1]),
        f"{prefix}/p50": float(xs[(n - 1) // 2]),
        f"{prefix}/p90": float(xs[min(n - 1, math.ceil(0.9 * n) - 1)]),
    }

"""A micro-batch's tensors: the samples of one index list, right-padded, in the next-token frame.

    mb = collate(batch, idx, pad_id)     # input_ids/attention_mask [b, L] (right-padded),
                                         # targets/resp_mask/behav_logp [b, L-1]
    mb.layout = PackedLayout.build(...)  # the packed forward's view of the same samples
    mb.routes, mb.routed = padded_routes(rows, L, moe)  # HF's forward's replay (MoE)
    mb = mb.to(device)

Next-token frame: logits at position j predict token j+1, so response token k of a
sample with P prompt tokens (input position P+k) sits at frame position P+k-1.
resp_mask is the response frame times the trajectory's loss mask, so an environment token is
never a target of the loss (zero gradient). The trained model builds them
(laminar/trainer/model.py `micro_batch`) from the index lists of laminar/trainer/packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from laminar.models.moe import MoeShape
from laminar.trainer.batch import Sample, TrainBatch

if TYPE_CHECKING:
    from laminar.trainer.packed import PackedLayout


@dataclass
class MicroBatch:
    index: torch.Tensor
    """[b] positions of these samples in the TrainBatch."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    resp_mask: torch.Tensor
    behav_logp: torch.Tensor
    resp_index: torch.Tensor
    """[N] flat positions of resp_mask's True entries in [b * (L-1)], row-major: the positions
    whose log-probabilities are computed (no data-dependent shapes on the device)."""
    layout: PackedLayout | None = None
    """The same samples for the packed forward (trainer/packed.py), when it runs."""
    vision: dict[str, torch.Tensor] | None = None
    """Vision-language models: pixel_values, image_grid_thw (the rows' images in row order) and
    mm_token_type_ids, as HF's forward takes them (laminar/trainer/vision.py)."""
    routes: torch.Tensor | None = None
    """MoE routing replay in HF's padded forward: [b, L, moe_layers, k] long, the rollout's
    expert ids at each row position (the packed forward reads the layout's instead)."""
    routed: torch.Tensor | None = None
    """[b, L] bool: the position has a recorded route (the others route live)."""

    def to(self, device: str | torch.device) -> MicroBatch:
        dev = torch.device(device)
        return MicroBatch(
            self.index.to(dev),
            self.input_ids.to(dev),
            self.attention_mask.to(dev),
            self.targets.to(dev),
            self.resp_mask.to(dev),
            self.behav_logp.to(dev),
            self.resp_index.to(dev),
            None if self.layout is None else self.layout.to(dev),
            None if self.vision is None else {k: v.to(dev) for k, v in self.vision.items()},
            None if self.routes is None else self.routes.to(dev),
            None if self.routed is None else self.routed.to(dev),
        )

    @property
    def n_tokens(self) -> int:
        return int(self.resp_mask.sum())


def collate(batch: TrainBatch, index: list[int], pad_id: int = 0) -> MicroBatch:
    rows = [batch.samples[i] for i in index]
    L = max(s.length for s in rows)
    b = len(rows)
    ids = torch.full((b, L), pad_id, dtype=torch.long)
    att = torch.zeros((b, L), dtype=torch.long)
    resp = torch.zeros((b, L - 1), dtype=torch.bool)
    behav = torch.zeros((b, L - 1), dtype=torch.float32)
    for r, s in enumerate(rows):
        p, n = len(s.prompt_ids), len(s.response_ids)
        ids[r, :p] = torch.from_numpy(s.prompt_ids)
        ids[r, p : p + n] = torch.from_numpy(s.response_ids)
        att[r, : p + n] = 1
        resp[r, p - 1 : p - 1 + n] = True if s.loss_mask is None else torch.from_numpy(s.loss_mask)
        behav[r, p - 1 : p - 1 + n] = torch.from_numpy(s.behav_logp)
    return MicroBatch(
        torch.tensor(index, dtype=torch.long),
        ids,
        att,
        ids[:, 1:].clone(),
        resp,
        behav,
        resp.flatten().nonzero().squeeze(1),
    )


def padded_routes(
    rows: list[Sample], length: int, moe: MoeShape
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(routes [b, L, moe_layers, k], routed [b, L]) of right-padded rows for HF's forward, or
    (None, None) where no row has routes. Row r's position p is its sample's position p of
    prompt + response; a sample's routes that do not fit `moe` are not replayed (as in the packed
    layout: trainer/packed.py)."""
    if all(s.routes is None for s in rows):
        return None, None
    routes = np.zeros((len(rows), length, len(moe.layers), moe.top_k), np.int64)
    routed = np.zeros((len(rows), length), bool)
    for r, s in enumerate(rows):
        if s.routes is not None and moe.check(s.routes, s.length) is None:
            n = len(s.routes)
            routes[r, :n], routed[r, :n] = s.routes, True
    return torch.from_numpy(routes), torch.from_numpy(routed)

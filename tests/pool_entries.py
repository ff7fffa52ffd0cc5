"""A served sample's first partial-pool entry, as a rollout's first flush of it sends it.

    await rollout_cli.send(first_entry(item, 0, "r0", [5, 6]))   # header + tokens at offset 0

The header carries what a resume needs (the group's prompt, size and images); the entry's
logprobs are all `logprob`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from laminar.protocol.data import PartialChunk, PartialTrajectory, PromptItem


def first_entry(
    item: PromptItem,
    index: int,
    rollout_id: str,
    ids: Sequence[int],
    *,
    version: int = 0,
    logprob: float = -0.1,
) -> PartialChunk:
    """Sample `index` of `item`'s group: its header and first tokens, from `rollout_id`."""
    uid = f"{item.group_id}/{index}"
    header = PartialTrajectory(
        uid=uid,
        group_id=item.group_id,
        prompt_uid=item.uid,
        sample_index=index,
        prompt_ids=item.prompt_ids,
        response_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        version=version,
        n=item.n,
        rollout_id=rollout_id,
        image_digests=item.image_digests,
    )
    return PartialChunk(
        uid=uid,
        version=version,
        offset=0,
        token_ids=np.asarray(ids, np.int32),
        logprobs=np.full(len(ids), logprob, np.float32),
        rollout_id=rollout_id,
        header=header,
    )

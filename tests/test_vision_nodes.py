"""Images through a real buffer node (inproc): a group's image served once with its PromptItem,
fetched by digest (ImageFetch) by another rollout and the trainer, the partial pool's recovery
and a buffer restart (journal replay) keeping the digest, unknown digests refused and counted."""

from __future__ import annotations

import asyncio
import random
import time

from laminar.models.tiny_vlm import build_tiny_vlm
from laminar.protocol.buffer import ImageBlobs, ImageFetch, PartialsRequest
from laminar.tasks import colours
from laminar.vision.images import ImageLimits, digest_of
from laminar.vision.store import ImageCache
from tests.pool_entries import first_entry
from tests.test_buffer_node import Harness, N, make_cfg, prompts


async def test_images_cross_once_and_are_fetched_by_digest(tmp_path):
    vlm = build_tiny_vlm(tmp_path / "vlm", image_size=56)
    paths = colours.write_splits(tmp_path / "colours", train=6, eval_=1, seed=0)
    cfg = make_cfg(
        tmp_path,
        model={"path": str(vlm)},
        data={"train": str(paths["train"]), "max_prompt_tokens": 64},
        buffer={"fsync": "batch", "journal": True},
    )
    h = await Harness(cfg).start()
    try:
        ro, other = await h.client("r0"), await h.client("r1")
        tr = await h.client("t0", "trainer")
        mgr = await h.client("m0", "manager")
        items = (await prompts(ro, 2)).items
        assert len(items) == 2
        for item in items:  # one image per group, with its digest; n samples share it
            assert item.n == N and len(item.images) == 1
            assert item.image_digests == [digest_of(item.images[0])]
        item = items[0]
        # a sample streams to the partial pool with the digest only
        uid = f"{item.group_id}/0"
        await ro.send(first_entry(item, 0, "r0", [5, 6], logprob=-0.3))
        # r0 dies: the manager's recovery query hands the partial (digest, no pixels) on
        deadline = time.monotonic() + 5
        while True:
            reply = await mgr.request(PartialsRequest(rollout_id="r0"))
            got = {p.uid: p for p in reply.partials}
            if (uid in got and len(got[uid].response_ids) == 2) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)  # poll interval of a deadline-bounded wait
        assert got[uid].image_digests == item.image_digests
        assert got[f"{item.group_id}/1"].image_digests == item.image_digests  # never started
        # the destination (another rollout) and the trainer fetch the pixels by digest
        for cli in (other, tr):
            cache = ImageCache(ImageLimits())
            blobs = await cli.request(ImageFetch(digests=cache.missing(got[uid].image_digests)))
            assert isinstance(blobs, ImageBlobs) and not blobs.missing
            cache.add_fetched(blobs.digests, blobs.data)
            assert cache.get(item.image_digests[0]) == item.images[0]
        unknown = await other.request(ImageFetch(digests=["sha256:" + "0" * 64]))
        assert unknown.missing == ["sha256:" + "0" * 64] and unknown.data == []
        assert h.buffer.metrics.counters["images_missing"] == 1
        assert h.buffer.metrics.counters["image_bytes_served"] == 2 * len(item.images[0])
        # the buffer restarts (journal replay): the open group keeps its reference, the image
        # is served again from the rows
        await h.stop_buffer()
        await h.start_buffer()
        mgr2, dest = await h.client("m1", "manager"), await h.client("r2")
        reply = await mgr2.request(PartialsRequest(rollout_id="r0"))
        mine = [p for p in reply.partials if p.group_id == item.group_id]
        assert mine and all(p.image_digests == item.image_digests for p in mine)
        blobs = await dest.request(ImageFetch(digests=item.image_digests))
        assert blobs.data == item.images
    finally:
        await h.close()


async def test_images_put_in_later_turns_are_kept_checked_and_served(tmp_path):
    """ImagePut (an environment's or an agent's image): kept on disk by the real buffer, served by
    digest (also after a restart), a corrupted or oversized one refused and counted."""
    from laminar.protocol.buffer import ImagePut, ImagePutReply

    vlm = build_tiny_vlm(tmp_path / "vlm", image_size=56)
    paths = colours.write_splits(tmp_path / "colours", train=4, eval_=1, seed=0)
    shot = colours.draw(random.Random(3), "red")
    cfg = make_cfg(
        tmp_path,
        model={"path": str(vlm)},
        data={
            "train": str(paths["train"]),
            "max_prompt_tokens": 64,
            "max_image_bytes": len(shot) + 10,
        },
        buffer={"fsync": "batch", "journal": True},
    )
    h = await Harness(cfg).start()
    try:
        ro = await h.client("r0")
        big = colours.draw(random.Random(4), "blue", size=200)
        assert len(big) > len(shot) + 10
        bad = shot[:-20]  # truncated: its own digest, but not a whole image
        digests = [digest_of(shot), digest_of(bad), digest_of(big), digest_of(b"x")]
        reply = await ro.request(ImagePut(digests=digests, data=[shot, bad, big, shot]))
        assert isinstance(reply, ImagePutReply)
        assert reply.stored == [digest_of(shot)] and reply.refused == digests[1:]
        counters = h.buffer.metrics.counters
        assert counters["bad_images_put"] == 3 and counters["image_bytes_put"] == len(shot)
        # again: already held, not written twice
        again = await ro.request(ImagePut(digests=[digest_of(shot)], data=[shot]))
        assert again.stored == [digest_of(shot)] and counters["images_put"] == 1
        blobs = await ro.request(ImageFetch(digests=[digest_of(shot)]))
        assert blobs.data == [shot]
        await h.stop_buffer()
        await h.start_buffer()
        blobs = await (await h.client("r1")).request(ImageFetch(digests=[digest_of(shot)]))
        assert blobs.data == [shot] and not blobs.missing
    finally:
        await h.close()

"""Images in later turns (laminar/vision/turns.py): an environment shows the model a screenshot
after its first turn. On a rollout running the tiny Qwen2-VL (VlmEngine) against the fake
buffer of tests/rollout_fakes.py and a real manager, over inproc:

  * the observation's placeholders are expanded exactly as the model's HF processor expands the
    same text and image;
  * the screenshot crosses the wire once (one ImagePut for a group whose samples all show it),
    samples and partials carry its digest after the prompt's;
  * the trainer's logprobs of the model's tokens (prompt image + screenshot in the forward) equal
    the engine's;
  * a repack move of an episode waiting after the screenshot: the destination fetches both
    images by digest, replays the screenshot turn without a mismatch and finishes it;
  * a bad image (undecodable, over data.max_image_bytes) ends its episode in error, counted, and
    the rollout goes on.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
import torch
from rollout_fakes import harness, make_cfg, uids_of, wait_for

from laminar.data.vision_prompts import VisionEncoder
from laminar.engines.vlm_engine import VlmEngine
from laminar.envs.base import Environment, StepContext, StepResult
from laminar.models.tiny_vlm import build_tiny_vlm, load_processor, load_vlm
from laminar.protocol.data import PromptItem
from laminar.protocol.rollout import ExportReply, ExportRequest, ImportReply, ImportRequest
from laminar.tasks import colours
from laminar.vision.images import ImageLimits, decode_rgb, digest_of
from laminar.vision.rows import image_messages
from laminar.vision.store import ImageCache
from laminar.vision.turns import TurnImages
from laminar.wiring.nodes import build_node


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm"), image_size=56))


def screenshot(colour: str) -> bytes:
    return colours.draw(random.Random(7), colour)


class ScreenEnv(Environment):
    """Turn 0's step shows a screenshot (the row's colour) with a line of text; turn 1's waits for
    `gate` (when given, and not replaying), then ends the episode. `bad`: turn 0 shows bytes that
    are not an image."""

    def __init__(self, gate: asyncio.Event | None = None, bad: bytes = b""):
        self.gate, self.bad = gate, bad

    def reset(self, row: dict[str, Any], prompt: str) -> dict[str, Any]:
        return {"colour": row["colour"]}

    async def step(self, state: dict[str, Any], ctx: StepContext, model_text: str) -> StepResult:
        if ctx.turn == 0:
            img = self.bad or screenshot(state["colour"])
            return StepResult(observation="screen", role="user", images=[img])
        if self.gate is not None and not ctx.replay:
            await self.gate.wait()
        return StepResult(done=True)


def items(path: str, colours_: list[str], n: int) -> list[PromptItem]:
    proc = load_processor(path)
    out = []
    for k, c in enumerate(colours_):
        png = colours.draw(random.Random(k), c)
        msgs, imgs = image_messages(
            [{"role": "user", "content": "<image>colour?"}], [png], None, ImageLimits()
        )
        ids, _ = VisionEncoder(proc).encode(msgs, imgs)
        out.append(
            PromptItem(
                uid=f"v{k}",
                group_id=f"v{k}@0",
                prompt_ids=ids,
                n=n,
                prompt="colour?",
                row={"colour": c},
                image_digests=[digest_of(png)],
                images=[png],
            )
        )
    return out


def config(tmp_path, path: str, **over: Any):
    return make_cfg(
        tmp_path,
        model={"path": path},
        rollout__engine="torch",
        rollout__sampling={"temperature": 1.0, "max_tokens": 64},
        env={"limits": {"max_turn_tokens": 4, "max_turns": 3}},
        **over,
    )


async def add(h: Any, path: str, env: Environment) -> Any:
    engine = VlmEngine(load_vlm(path), load_processor(path))
    node = build_node(h.cfg, "rollout", len(h.rollouts), ctx=h.ctx, engine=engine, env=env)
    return await h.start_node(node)


def test_turn_placeholders_expand_as_the_processor_does(vlm):
    proc = load_processor(vlm)
    turns = TurnImages(proc, ImageLimits(), ImageCache(ImageLimits()), put=_no_put)
    png = screenshot("red")
    imgs = turns.load([png, png])
    text = f"user: {turns.placeholder}a{turns.placeholder}b\n"
    one = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    ours = turns.expand(one, turns.token_counts(imgs))
    want = proc(text=[text], images=[decode_rgb(png)] * 2, return_tensors="np")["input_ids"][0]
    assert ours == want.tolist() and ours.count(turns.image_token_id) > 2
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        turns.expand(one, turns.token_counts(imgs[:1]))


async def _no_put(digests: list[str], data: list[bytes]) -> None:
    raise AssertionError("no put expected")


async def test_a_screenshot_crosses_once_and_trains_at_its_place(vlm, tmp_path):
    from laminar.trainer.torch_trainer import TorchTrainer
    from laminar.wiring.trainer import trainer_settings
    from tests.test_vlm_trainer import make_cfg as trainer_cfg

    its = items(vlm, ["red", "blue"], n=3)
    async with harness(config(tmp_path, vlm), its) as h:
        node = await add(h, vlm, ScreenEnv())
        await h.wait_stored(uids_of(its), 60)
        proc = load_processor(vlm)
        tok = int(proc.image_token_id)
        shots = {c: screenshot(c) for c in ("red", "blue")}
        # one put per distinct screenshot, whatever the group's samples: 3 samples, 1 image each
        put = [d for p in h.state.puts for d in p.digests]
        assert sorted(put) == sorted(digest_of(s) for s in shots.values())
        assert node.turn_images is not None
        assert node.turn_images.put_bytes == sum(len(s) for s in shots.values())
        per_image = TurnImages(proc, ImageLimits(), ImageCache(ImageLimits()), put=_no_put)
        run = per_image.token_counts(per_image.load([shots["red"]]))[0]
        trained, untrainable = [], []
        for t in h.state.stored.values():
            colour = t.row["colour"]
            sampled = (t.response_ids == tok) & (t.loss_mask == 1)
            if t.turns < 2:  # the model's first turn sampled the placeholder: ended there
                assert sampled.any() and t.image_digests == its[0 if colour == "red" else 1].image_digests
                continue
            want = [its[0 if colour == "red" else 1].image_digests[0], digest_of(shots[colour])]
            assert t.image_digests == want
            at = np.flatnonzero((t.response_ids == tok) & (t.loss_mask == 0))
            assert len(at) == run and (np.diff(at) == 1).all()  # the environment's one run
            (untrainable if sampled.any() else trained).append(t)
        assert len(trained) >= 3
        assert node.metrics.counters["turn_images"] == len(trained) + len(untrainable)
        # the trainer: prompt image + screenshot in the forward, logprobs equal the engine's
        trainer = TorchTrainer(trainer_settings(trainer_cfg(vlm, tmp_path / "t")), vlm)
        for i, t in enumerate(trained):  # ScreenEnv does not score: any reward will do
            t.reward = float(i % 2)
        batch = trainer.prepare(trained + untrainable, dict(h.state.images))
        assert batch.n_seqs == len(trained), batch.dropped
        assert batch.dropped.get("placeholder_in_response", 0) == len(untrainable)
        mb = trainer.model.micro_batch(batch, list(range(batch.n_seqs)))
        assert mb.vision is not None and mb.vision["image_grid_thw"].shape == (2 * batch.n_seqs, 3)
        with torch.no_grad():
            logp, _ = trainer.model.token_logprobs(mb)
        by_uid = {t.uid: t for t in trained}
        for i, s in enumerate(batch.samples):
            t = by_uid[s.uid]
            model = np.asarray(t.loss_mask) == 1
            got = logp[i][mb.resp_mask[i]].numpy()  # the loss mask's positions: the model's tokens
            np.testing.assert_allclose(got, t.logprobs[model], atol=1e-4)


async def test_repack_after_a_screenshot_fetches_it_by_digest(vlm, tmp_path):
    its = items(vlm, ["green"], n=2)
    gate = asyncio.Event()
    async with harness(config(tmp_path, vlm), its) as h:
        src = await add(h, vlm, ScreenEnv(gate))
        uids = uids_of(its)

        def at_turn1() -> bool:
            seqs = list(src.table.seqs.values())
            return len(seqs) + len(h.state.stored) == 2 and all(
                s.waiting and s.turn == 1 for s in seqs
            )

        await wait_for(at_turn1, 60, "every episode waiting in turn 1's step")
        moving = set(src.table.seqs)
        assert moving, "both episodes ended before the screenshot"
        dst = await add(h, vlm, ScreenEnv(gate))
        srv = h.manager.srv
        reply = await srv.request("rollout-0", ExportRequest(uids=sorted(moving)), timeout=5)
        assert isinstance(reply, ExportReply)
        shot = digest_of(screenshot("green"))
        for p in reply.partials:
            assert p.image_digests == [its[0].image_digests[0], shot] and p.awaiting_env
        # the partial pool's record restarted with a header that names the screenshot
        for uid in moving:
            assert h.state.partials[uid]["header"].image_digests[-1] == shot
        gate.set()
        fetched_before = len(h.state.fetched)
        got = await srv.request("rollout-1", ImportRequest(partials=reply.partials), timeout=10)
        assert isinstance(got, ImportReply) and set(got.accepted) == moving
        assert h.state.fetched[fetched_before:] == [its[0].image_digests[0], shot]
        await h.wait_stored(uids, 60)
        for uid in moving:
            t = h.state.stored[uid]
            assert t.rollout_id == "rollout-1" and t.image_digests[-1] == shot
        assert dst.metrics.counters["images_fetched"] == 2
        assert dst.metrics.counters["episodes_replayed"] == len(moving)
        assert dst.metrics.counters.get("replay_mismatch", 0) == 0
        assert len(h.state.puts) == 1  # the destination never put the screenshot again


@pytest.mark.parametrize("bad", ["undecodable", "oversized"])
async def test_a_bad_turn_image_ends_its_episode_counted(vlm, tmp_path, bad):
    its = items(vlm, ["red"], n=2)
    over: dict[str, Any] = {}
    img = b"\x89PNG not really"
    if bad == "oversized":
        img = screenshot("red")
        over["data"] = {"max_image_bytes": len(img) - 1}
        # the prompt's image must still pass: make it smaller than the screenshot
        assert len(its[0].images[0]) <= len(img) - 1 or pytest.skip("prompt image too large")
    async with harness(config(tmp_path, vlm, **over), its) as h:
        node = await add(h, vlm, ScreenEnv(bad=img))
        await h.wait_stored(uids_of(its), 60)
        errored = [t for t in h.state.stored.values() if t.finish_reason == "error"]
        placeholder = [t for t in h.state.stored.values() if t.finish_reason != "error"]
        assert len(errored) + len(placeholder) == 2 and errored
        assert all(t.reward is None and "image" in t.reward_error for t in errored)
        assert node.metrics.counters["turn_bad_images"] == len(errored)
        assert not h.state.puts
        await wait_for(lambda: node.ready.is_set() and not node.stopping.is_set(), 1, "alive")

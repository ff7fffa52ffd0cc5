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

    # ~19% of episodes end before the screenshot or sample its placeholder (untrainable): with
    # 3 samples a colour, fewer than 3 of 6 trained in ~2% of runs; with 5, ~0.1%
    its = items(vlm, ["red", "blue"], n=5)
    async with harness(config(tmp_path, vlm), its) as h:
        node = await add(h, vlm, ScreenEnv())
        await h.wait_stored(uids_of(its), 60)
        proc = load_processor(vlm)
        tok = int(proc.image_token_id)
        shots = {c: screenshot(c) for c in ("red", "blue")}
        # one put per distinct screenshot, whatever the group's samples: 5 samples, 1 image each
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
                assert (
                    sampled.any()
                    and t.image_digests == its[0 if colour == "red" else 1].image_digests
                )
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
        for i, t in enumerate(trained + untrainable):  # ScreenEnv does not score: any will do
            t.reward = float(i % 2)
        batch = trainer.prepare(trained + untrainable, dict(h.state.images))
        assert batch.dropped.get("placeholder_in_response", 0) == len(untrainable)
        lone = batch.dropped.get("singleton_group", 0)  # a group left with one sample
        assert batch.n_seqs == len(trained) - lone >= 2, batch.dropped
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
    # sampling is unseeded, and an episode whose first turn samples EOS or the image placeholder
    # ends before the screenshot: 5 of 36 episodes did in six runs, so with 2 samples both did in
    # ~2% of runs (a CI failure, 2026-12-06); all 6 do in ~10^-5
    its = items(vlm, ["green"], n=6)
    gate = asyncio.Event()
    async with harness(config(tmp_path, vlm), its) as h:
        src = await add(h, vlm, ScreenEnv(gate))
        uids = uids_of(its)

        def at_turn1() -> bool:
            seqs = list(src.table.seqs.values())
            return len(seqs) + len(h.state.stored) == len(uids) and all(
                s.waiting and s.turn == 1 for s in seqs
            )

        await wait_for(at_turn1, 60, "every episode waiting in turn 1's step")
        moving = set(src.table.seqs)
        assert moving, "every episode ended before the screenshot"
        shot = digest_of(screenshot("green"))

        # the partial pool's record restarted with a header that names the screenshot
        def named() -> bool:
            recs = [h.state.partials.get(uid) for uid in moving]
            return all(r and r["header"].image_digests[-1:] == [shot] for r in recs)

        await wait_for(named, 10, "the partial pool's headers naming the screenshot")
        dst = await add(h, vlm, ScreenEnv(gate))
        srv = h.manager.srv
        reply = await srv.request("rollout-0", ExportRequest(uids=sorted(moving)), timeout=5)
        assert isinstance(reply, ExportReply)
        for p in reply.partials:
            assert p.image_digests == [its[0].image_digests[0], shot] and p.awaiting_env
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
    # an episode whose first turn samples EOS or the image placeholder ends before the screenshot
    # (~14% of episodes): with 2 samples both did in ~2% of runs (a CI failure, 2026-12-07);
    # all 6 do in ~10^-5
    its = items(vlm, ["red"], n=6)
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
        early = [t for t in h.state.stored.values() if t.finish_reason != "error"]
        assert len(errored) + len(early) == 6 and errored
        assert all(t.turns < 2 for t in early)  # only those that never reached the screenshot
        assert all(t.reward is None and "image" in t.reward_error for t in errored)
        assert node.metrics.counters["turn_bad_images"] == len(errored)
        assert not h.state.puts
        await wait_for(lambda: node.ready.is_set() and not node.stopping.is_set(), 1, "alive")


async def test_an_agent_sends_a_screenshot_in_a_later_call(vlm, tmp_path, monkeypatch):
    """A remote OpenAI-client agent: its second call adds a user message with an image_url part
    (a data: URI). The image goes to the buffer once, the trajectory carries
    its digest and its placeholder run as context tokens; a first call with an image is refused."""
    import base64

    import aiohttp

    from laminar.cluster import LocalCluster
    from tests.test_agents import capture
    from tests.test_agents import make_cfg as agent_cfg

    monkeypatch.setenv("LAMINAR_AGENT_KEY", "k")
    cfg = agent_cfg(
        tmp_path,
        vlm,
        "vlm-agent",
        rows=4,
        agent={"fn": None, "remote": True},
        rollout={"sampling": {"max_tokens": 40, "temperature": 1.0}},
    )
    png = screenshot("blue")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    async with LocalCluster(cfg) as cluster:
        rollout = await cluster.add("rollout", 0)
        got = capture(rollout)
        base = rollout.endpoint.url
        async with aiohttp.ClientSession() as http:
            key = {"Authorization": "Bearer k"}
            chat = f"{base}/v1/chat/completions"
            image = {"type": "image_url", "image_url": {"url": url}}
            shown = {"role": "user", "content": [image, {"type": "text", "text": "colour?"}]}
            for attempt in range(4):  # a random model's answer may hold the placeholder token:
                # that episode cannot go on (its next prefill would misplace the image)
                r = await http.post(f"{base}/laminar/v1/episodes/claim?wait_s=20", headers=key)
                assert r.status == 200, await r.text()
                ep = await r.json()
                auth = {"Authorization": f"Bearer {ep['episode']}"}
                if attempt == 0:
                    body = {"messages": [shown], "max_tokens": 3}
                    r = await http.post(chat, json=body, headers=auth)
                    assert r.status == 400 and "first one" in (await r.json())["error"]["message"]
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "look"}]
                r = await http.post(chat, json={"messages": msgs, "max_tokens": 2}, headers=auth)
                assert r.status == 200, await r.text()
                msgs += [(await r.json())["choices"][0]["message"], shown]
                r = await http.post(chat, json={"messages": msgs, "max_tokens": 3}, headers=auth)
                ok = r.status == 200
                assert ok or (await r.json())["error"]["code"] == "episode_closed"
                if ok:
                    r = await http.post(
                        f"{base}/laminar/v1/episodes/close", json={"reward": 1.0}, headers=auth
                    )
                    assert r.status == 200
                    break
            assert ok
        await wait_for(lambda: any(t.reward == 1.0 for t in got), 20, "the episode delivered")
        t = next(t for t in got if t.reward == 1.0)
        assert t.image_digests == [digest_of(png)]
        proc = load_processor(vlm)
        tok = int(proc.image_token_id)
        at = np.flatnonzero(t.response_ids == tok)
        mask = np.asarray(t.loss_mask)
        # the screenshot: one run of environment tokens (mask 0). The random model may also sample
        # the placeholder id in its last answer, after it: that one is its own token (mask 1)
        shot = at[mask[at] == 0]
        assert len(shot) > 1 and (np.diff(shot) == 1).all()
        assert (at[mask[at] == 1] > shot[-1]).all()
        buffer = cluster.node("buffer-0")
        assert buffer.metrics.counters["image_bytes_put"] == len(png)
        assert buffer.images.holds(digest_of(png))
        assert rollout.metrics.counters["turn_images"] == 1


def test_a_moved_agent_episode_with_an_image_matches_its_record(vlm):
    """laminar/agents/resume.py: the record (prompt, the model's answer, the image message's
    tokens with the placeholders expanded) is matched by the agent's repeated messages only when
    the destination expands the placeholders as the processor does."""
    import base64

    from laminar.agents.render import ChatRenderer, image_urls
    from laminar.agents.resume import match_record
    from laminar.models.prompt_tokenizer import load_prompt_tokenizer

    proc = load_processor(vlm)
    turns = TurnImages(proc, ImageLimits(), ImageCache(ImageLimits()), put=_no_put)
    render = ChatRenderer(load_prompt_tokenizer(vlm, chat_template=True), turns.placeholder)
    png = screenshot("red")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    first = [{"role": "user", "content": "look"}]
    answer_ids = render.encode("ok")
    answer, _ = render.assistant_message(render.decode(answer_ids), False, "u", 0)
    shown = [{"role": "user", "content": [image, {"type": "text", "text": "colour?"}]}]

    def expand(ids: list[int], msgs: list[dict[str, Any]]) -> list[int]:
        return turns.expand(ids, turns.token_counts(turns.load(image_urls(msgs))))

    delta = expand(render.delta_ids(shown, False), shown)
    prompt = np.asarray(render.first_ids(first, None), np.int32)
    ids = np.asarray(answer_ids + delta, np.int32)
    mask = np.asarray([1] * len(answer_ids) + [0] * len(delta), np.uint8)
    msgs = first + [answer] + shown
    got = match_record(render, "u", prompt, ids, mask, msgs, None, False, expand=expand)
    assert got is not None and got.calls == 1 and got.new == [] and got.keep == len(ids)
    assert match_record(render, "u", prompt, ids, mask, msgs, None, False) is None
    # the call's own image message not recorded yet: its tokens and its image URL come back
    got = match_record(
        render,
        "u",
        prompt,
        ids[: len(answer_ids)],
        mask[: len(answer_ids)],
        msgs,
        None,
        False,
        expand=expand,
    )
    assert got is not None and got.new == delta and got.new_images == [url]


async def test_a_moved_agent_episode_with_a_screenshot_resumes_on_the_other_rollout(
    vlm, tmp_path, monkeypatch
):
    """A remote agent's episode showed a screenshot (its second call), then repack moves it from
    rollout-0 to rollout-1: the agent's next call, repeated on rollout-1, matches the record with
    the screenshot's placeholders expanded (no mismatch), rollout-1 fetched the screenshot from the
    buffer by digest, and the delivered trajectory keeps its reference."""
    import base64

    import aiohttp

    from laminar.cluster import LocalCluster
    from laminar.manager.repack import Move
    from tests.test_agents import capture, manager_sees
    from tests.test_agents import make_cfg as agent_cfg

    monkeypatch.setenv("LAMINAR_AGENT_KEY", "k")
    cfg = agent_cfg(
        tmp_path,
        vlm,
        "vlm-agent-move",
        rows=2,
        agent={"fn": None, "remote": True},
        rollout={"sampling": {"max_tokens": 160, "temperature": 1.0}, "credits": 1},
    )
    png = screenshot("green")
    tok = int(load_processor(vlm).image_token_id)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    shown = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "?"},
        ],
    }
    async with LocalCluster(cfg) as cluster:
        r0 = await cluster.add("rollout", 0)
        key = {"Authorization": "Bearer k"}
        async with aiohttp.ClientSession() as http:
            for _ in range(6):  # a random model's answer may hold the placeholder: try another
                r = await http.post(
                    f"{r0.endpoint.url}/laminar/v1/episodes/claim?wait_s=20", headers=key
                )
                assert r.status == 200, await r.text()
                ep = await r.json()
                auth = {"Authorization": f"Bearer {ep['episode']}"}
                chat = f"{r0.endpoint.url}/v1/chat/completions"
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "look"}]
                r = await http.post(chat, json={"messages": msgs, "max_tokens": 2}, headers=auth)
                assert r.status == 200, await r.text()
                msgs += [(await r.json())["choices"][0]["message"], shown]
                r = await http.post(chat, json={"messages": msgs, "max_tokens": 2}, headers=auth)
                if r.status != 200:
                    continue
                msgs.append((await r.json())["choices"][0]["message"])
                uid = next(u for u, e in r0.agents.live.by_uid.items() if e.token == ep["episode"])
                seq = r0.agents.live.by_uid[uid].seq
                ids, mask = seq.ids.copy(), seq.mask.copy()
                if not ((ids == tok) & (mask == 1)).any():  # its next call could go on
                    break
            assert r.status == 200
            r1 = await cluster.add("rollout", 1)
            got1 = capture(r1)
            await manager_sees(cluster, "rollout-1")
            mgr = cluster.node("manager-0")
            out = await mgr.repacker.move(
                Move("rollout-0", "rollout-1", (uid,), 0), refresh=False, trainer_version=0
            )
            assert out["moved"] == 1, out
            msgs.append({"role": "user", "content": "more"})
            chat1 = f"{r1.endpoint.url}/v1/chat/completions"
            r = await http.post(chat1, json={"messages": msgs, "max_tokens": 2}, headers=auth)
            assert r.status == 200, await r.text()
            r = await http.post(
                f"{r1.endpoint.url}/laminar/v1/episodes/close", json={"reward": 1.0}, headers=auth
            )
            assert r.status == 200, await r.text()
        await wait_for(lambda: any(t.uid == uid for t in got1), 20, "the moved episode delivered")
        c1 = r1.metrics.counters
        assert c1.get("agent_calls_resumed") == 1 and not c1.get("agent_resume_mismatch")
        assert c1.get("images_fetched") == 1 and "turn_images_put" not in c1
        t = next(t for t in got1 if t.uid == uid)
        assert t.image_digests == [digest_of(png)] and t.rollout_id == "rollout-1"

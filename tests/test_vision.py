"""Vision-language prompts: the tiny Qwen2-VL, row shapes, placeholder expansion against HF's
processor, bad images, and an image crossing the wire once per group by digest."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from laminar.buffer.partials import PartialPool
from laminar.buffer.prompts import PromptPool
from laminar.data.prompts import PromptEncoder, load_prompts
from laminar.data.vision_prompts import VisionEncoder
from laminar.manager.placement import restart
from laminar.models.tiny_vlm import build_tiny_vlm, is_vlm, load_processor
from laminar.protocol.buffer import ImageBlobs
from laminar.rollout.tracking import SeqState
from laminar.tasks import colours
from laminar.transport.codec import decode, encode
from laminar.vision.images import BadImage, ImageLimits, digest_of
from laminar.vision.pixels import pixel_inputs
from laminar.vision.rows import image_messages
from laminar.vision.store import ImageCache, ImageStore


def png(w: int, h: int, colour=(200, 20, 20)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), image_size=56)


@pytest.fixture(scope="module")
def proc(vlm):
    return load_processor(vlm)


def _wire_bytes(msg) -> int:
    return sum(len(memoryview(f).cast("B")) for f in encode(msg))


def test_tiny_vlm_is_a_qwen2_vl_directory(vlm, proc):
    cfg = json.loads((vlm / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_vl" and is_vlm(vlm)
    assert type(proc).__name__ == "Qwen2VLProcessor"
    assert proc.image_token_id == cfg["image_token_id"]
    assert (vlm / "preprocessor_config.json").exists() and (vlm / "tokenizer.json").exists()


@pytest.mark.parametrize("size", [(56, 56), (100, 60), (30, 200), (224, 224)])
def test_placeholder_expansion_matches_the_hf_processor(proc, size):
    data = png(*size)
    msgs, imgs = image_messages(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
        [data],
        None,
        ImageLimits(),
    )
    ids, text, grids = VisionEncoder(proc).encode_full(msgs, imgs)
    # HF's own path: template -> Qwen2VLProcessor.__call__ (replace_image_token)
    rendered = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    from PIL import Image

    ref = proc(text=[rendered], images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert ids.tolist() == ref["input_ids"][0].tolist()
    merge = proc.image_processor.merge_size
    want = int(np.prod(ref["image_grid_thw"][0])) // merge**2
    assert (
        int((ids == proc.image_token_id).sum()) == want
        and grids.tolist() == ref["image_grid_thw"].tolist()
    )
    assert text == "colour?"


def test_row_shapes_give_the_same_prompt(tmp_path, proc):
    data = png(40, 40)
    (tmp_path / "a.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    q = {"type": "text", "text": "colour?"}
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, q]}], "images": ["a.png"]},
        {"prompt": [{"role": "user", "content": "<image>colour?"}], "images": [{"path": "a.png"}]},
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, q]}]},
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, q]}
            ]
        },
    ]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({**r, "answer": "red"}) + "\n" for r in rows))
    got, report = load_prompts(f)
    assert report.bad == 0 and report.images == 4
    enc = VisionEncoder(proc)
    encoded = {tuple(enc.encode(r.prompt, r.images)[0].tolist()) for r in got}
    assert len(encoded) == 1
    assert {r.images[0].digest for r in got} == {digest_of(data)}
    assert all("images" not in r.row and r.row["answer"] == "red" for r in got)
    assert len({r.uid for r in got}) == 1  # the same content: the same derived uid


def test_bad_images_are_reported_with_file_and_row_and_skipped(tmp_path):
    good = png(40, 40)
    (tmp_path / "ok.png").write_bytes(good)
    (tmp_path / "broken.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "big.png").write_bytes(png(300, 300))
    part = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    rows = [
        {"prompt": part, "images": ["ok.png"]},
        {"prompt": part, "images": ["broken.png"]},  # truncated: unreadable
        {"prompt": part, "images": ["missing.png"]},
        {"prompt": part, "images": ["big.png"]},  # over max_image_pixels
        {"prompt": part, "images": ["ok.png", "ok.png"]},  # an image without a placeholder
        {"prompt": part, "images": []},  # a placeholder without an image
        {"prompt": part, "images": ["http://example.invalid/x.png"]},
    ]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, report = load_prompts(f, ImageLimits(max_bytes_per_prompt=1 << 20, max_pixels=200 * 200))
    assert len(got) == 1 and report.bad == 6 and report.bad_images == 6
    errs = "\n".join(report.errors)
    for line in range(2, 8):
        assert f"{f}:{line}: bad image" in errs
    assert "not a readable image" in errs and "max_image_pixels" in errs
    assert "placeholders" in errs and "remote image URLs" in errs
    # the bytes bound, per prompt
    _, small = load_prompts(f, ImageLimits(max_bytes_per_prompt=len(good) - 1))
    assert "data.max_image_bytes" in "\n".join(small.errors)


def test_a_text_model_refuses_image_rows(tmp_path):
    (tmp_path / "ok.png").write_bytes(png(40, 40))
    f = tmp_path / "rows.jsonl"
    row = {"prompt": "<image>colour?", "images": ["ok.png"]}
    f.write_text(json.dumps(row) + "\n" + json.dumps({"prompt": "plain"}) + "\n")
    rows, report = load_prompts(f)
    assert report.bad == 0 and len(rows) == 2
    pool = PromptPool(rows, PromptEncoder(None), shuffle=False)
    bad = []
    pool.on_bad = lambda where, why: bad.append((where, why))
    items, _ = pool.next_items(1, n=4)
    assert len(items) == 1 and items[0].images == [] and "vision-language" in bad[0][1]


def _colour_pool(tmp_path, proc, n_rows=3):
    paths = colours.write_splits(tmp_path / "colours", train=n_rows, eval_=1, seed=0)
    rows, report = load_prompts(paths["train"])
    assert report.bad == 0
    return PromptPool(rows, VisionEncoder(proc), shuffle=False), rows


def test_an_image_crosses_the_wire_once_per_group(tmp_path, proc):
    pool, rows = _colour_pool(tmp_path, proc)
    n = 8
    (item,), _ = pool.next_items(1, n=n)
    img = rows[0].images[0]
    assert item.image_digests == [img.digest] and item.images == [img.data]
    back = decode(encode(item))
    assert back.images == [img.data] and back.image_digests == item.image_digests
    prompt_bytes = _wire_bytes(item)
    text_item = type(item)(uid=item.uid, group_id=item.group_id, prompt_ids=item.prompt_ids, n=n)
    assert prompt_bytes - _wire_bytes(text_item) >= len(img.data)  # the bytes, once
    # a rollout keeps the group's image once; each of its n samples carries the digest only
    cache = ImageCache(ImageLimits())
    cache.add_item(item.image_digests, item.images)
    trajs = []
    for i in range(n):
        s = SeqState.from_item(item, i, version=0, now=0.0)
        s.append(np.array([5, 6], np.int32), np.zeros(2, np.float32), 0.0)
        trajs.append(s.trajectory("stop", "r0", 0.0))
    assert all(t.image_digests == [img.digest] for t in trajs)
    for t in trajs:  # a sample carries the digest (~80 bytes), never the image
        plain = decode(encode(t))
        plain.image_digests = []
        assert _wire_bytes(t) - _wire_bytes(plain) <= len(img.digest) + 32  # + the key
    assert cache.counts.prompt_bytes == len(img.data) and cache.counts.fetched_bytes == 0
    assert all(img.data not in b"".join(bytes(f) for f in encode(t)) for t in trajs)


def test_repack_and_resume_keep_the_reference_and_fetch_by_digest(tmp_path, proc):
    pool, rows = _colour_pool(tmp_path, proc)
    store = ImageStore.of_rows(rows)
    (item,), _ = pool.next_items(1, n=2)
    s = SeqState.from_item(item, 0, version=3, now=0.0)
    s.append(np.array([7, 8, 9], np.int32), np.full(3, -0.1, np.float32), 0.0)
    # a repack export (partial), and the manager's restart from the prompt
    exported = s.partial(s.ids.copy(), s.logprobs.copy(), "r0")
    moved = decode(encode(restart(exported, 3)))
    assert exported.image_digests == moved.image_digests == item.image_digests
    # a kill -9: the partial pool (fed by the rollout's chunks) answers the recovery query
    partials = PartialPool()
    chunk, _ = s.chunk("r0")
    partials.apply(decode(encode(chunk)))
    (recovered,) = partials.query("r0")
    assert recovered.image_digests == item.image_digests
    resumed = SeqState.from_partial(recovered, now=1.0)
    assert resumed.image_digests == item.image_digests and resumed.length == 3
    # the destination has never seen the image: it fetches it from the owner, checked
    dest = ImageCache(ImageLimits())
    need = dest.missing(resumed.image_digests)
    assert need == item.image_digests
    found, data, missing = store.serve(need)
    reply = decode(encode(ImageBlobs(digests=found, data=data, missing=missing)))
    dest.add_fetched(reply.digests, reply.data)
    assert dest.get(need[0]) == item.images[0] and not dest.missing(need)
    assert dest.counts.fetched_bytes == len(item.images[0]) and dest.counts.prompt_bytes == 0
    ids, _ = pool.encoder.encode(rows[0].prompt, rows[0].images)
    assert ids.tolist() == resumed.prompt_ids.tolist()


def test_corrupted_or_oversized_images_are_refused_and_counted():
    data = png(40, 40)
    d = digest_of(data)
    cache = ImageCache(ImageLimits(max_bytes_per_prompt=len(data) + 10))
    with pytest.raises(BadImage, match="do not match their digest"):
        cache.add_fetched([d], [data[:-5] + b"xxxxx"])
    with pytest.raises(BadImage, match="max_image_bytes"):
        cache.add_item([digest_of(data * 2)], [data * 2])
    with pytest.raises(BadImage, match="not a readable image"):
        bad = b"\x89PNG" + b"\0" * 40
        cache.add_item([digest_of(bad)], [bad])
    assert cache.counts.refused == 3 and cache.missing([d]) == [d]
    _, _, missing = ImageStore().serve([d])
    assert missing == [d]


def test_the_vlm_forward_takes_the_pixel_inputs(vlm, proc, tmp_path):
    import torch

    from laminar.models.tiny_vlm import load_vlm

    pool, rows = _colour_pool(tmp_path, proc, n_rows=2)
    (item,), _ = pool.next_items(1, n=1)
    model = load_vlm(vlm)
    px = pixel_inputs(proc, item.images)
    ids = torch.as_tensor(item.prompt_ids[None].astype(np.int64))
    mm = (ids == proc.image_token_id).long()
    out = model(
        input_ids=ids,
        mm_token_type_ids=mm,
        pixel_values=px.pixel_values,
        image_grid_thw=px.grid_thw,
    )
    assert out.logits.shape == (1, ids.shape[1], len(proc.tokenizer))
    other = pixel_inputs(proc, [colours.draw(__import__("random").Random(1), "blue")])
    out2 = model(
        input_ids=ids,
        mm_token_type_ids=mm,
        pixel_values=other.pixel_values,
        image_grid_thw=other.grid_thw,
    )
    assert not torch.allclose(out.logits[0, -1], out2.logits[0, -1])  # the image is read


def test_colours_task_is_deterministic_and_verifiable(tmp_path):
    a = colours.write_splits(tmp_path / "a", 5, 2, seed=3)
    b = colours.write_splits(tmp_path / "b", 5, 2, seed=3)
    assert a["train"].read_text() == b["train"].read_text()
    for row in map(json.loads, a["train"].read_text().splitlines()):
        assert (tmp_path / "a" / row["images"][0]).read_bytes() == (
            tmp_path / "b" / row["images"][0]
        ).read_bytes()
        assert colours.verify(colours.solve(row["answer"]), row["answer"]) == 1.0
    assert colours.reward("colour?", "#blue", answer="red") == {"reward": 0.0, "format": 1.0}
    assert colours.verify("red", "red") == 0.0
    # balanced: no colour is a better blind guess (the text ceiling is 1/4)
    rows = [r for r, _ in colours.generate(40, seed=1, split="train")]
    assert sorted(r["answer"] for r in rows) == sorted(sorted(colours.COLOURS) * 10)
    assert [r["answer"] for r in rows[:8]] != sorted(colours.COLOURS) * 2  # shuffled

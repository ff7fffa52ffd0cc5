"""The export streamed into the weight path (laminar/weights/sink.py, WeightPusher.push_stream):
the version a relay serves is byte for byte the unstreamed one, and a failure mid-stream never
publishes a partial version.

    .venv/bin/python -m pytest tests/test_weights_stream.py -q

A real TorchTrainer (one process, bf16 export of fp32 master weights) exports into the sink;
the relays run in this process (tests/inproc_relays.py), the rollout end is a WeightPuller.
The FSDP version of the byte check (2 gloo ranks) is in tests/test_trainer_dcp.py.
"""

from __future__ import annotations

import pytest
import torch

from laminar.trainer.batch import TrainBatch
from laminar.trainer.torch_trainer import TorchTrainer
from laminar.weights.digest import weights_digest
from laminar.weights.layout import layout_of, named_list
from laminar.weights.pusher import write_flat
from laminar.weights.sink import FlatSink, IncompleteVersion, VersionSink
from laminar.wiring.trainer import trainer_settings
from tests.test_trainer import make_cfg, make_trajs
from tests.test_weights import _puller, _pusher, inproc  # noqa: F401 - inproc: a fixture


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from laminar.models.tiny import build_tiny_model

    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2, kv_heads=1)
    )


@pytest.fixture
def policy(tiny, tmp_path):
    cfg = make_cfg(tiny, tmp_path / "run")
    cfg.model.dtype = "bfloat16"
    p = TorchTrainer(trainer_settings(cfg), tiny)
    p.train_step(TrainBatch.build(make_trajs(seed=1)))
    return p


def unstreamed(policy: TorchTrainer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The version as the whole-version path writes it (export, then write_flat)."""
    weights = policy.export()
    items = named_list(weights)
    layout = layout_of(items)
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    write_flat(flat, items, layout)
    return flat, weights


def test_streamed_bytes_and_digest_equal_the_unstreamed_version(policy):
    flat, weights = unstreamed(policy)
    layout = policy.stream_layout()
    assert layout is not None and layout == layout_of(named_list(weights))
    assert set(layout.dtypes) == {"bfloat16"}  # cast before it leaves the device
    dst = torch.full((layout.total_bytes,), 0xAB, dtype=torch.uint8)  # the padding gets zeroed
    sink = FlatSink(dst, layout, digest=True)
    policy.export_into(sink)
    digest = sink.finish(30)
    assert torch.equal(dst, flat)
    assert digest == weights_digest(weights.items())


def test_a_version_with_a_tensor_missing_or_out_of_order_is_refused(policy):
    layout = policy.stream_layout()
    assert layout is not None
    dst = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    sink = FlatSink(dst, layout, digest=False)
    weights = policy.export()
    names = list(weights)
    sink.put(names[0], weights[names[0]])
    with pytest.raises(IncompleteVersion, match="layout expects"):
        sink.put(names[2], weights[names[2]])  # skipped one
    with pytest.raises(IncompleteVersion, match="1 of"):
        sink.finish(30)


class Failing:
    """A sink that passes `good` tensors on, then fails (a broken write, a full disk)."""

    def __init__(self, inner: VersionSink, good: int):
        self.inner, self.good, self.seen = inner, good, 0

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self.seen += 1
        if self.seen > self.good:
            raise OSError("injected: the write failed")
        self.inner.put(name, tensor)


async def test_relay_serves_the_streamed_version_and_never_a_partial_one(
    inproc,  # noqa: F811 - the fixture imported above
    zctx,
    policy,
):
    import asyncio

    cfg, _ = await inproc(1)
    pusher, puller = _pusher(cfg, zctx), _puller(cfg, zctx)
    await pusher.start()
    await puller.start()
    layout = policy.stream_layout()
    assert layout is not None
    try:
        flat, weights = unstreamed(policy)

        async def produce(sink: VersionSink) -> None:
            await asyncio.to_thread(policy.export_into, sink)

        stall, digest = await pusher.push_stream(1, layout, produce, digest=True)
        assert stall > 0 and pusher.mode == "shm" and digest == weights_digest(weights.items())
        await puller.wait_version(1, timeout=10)
        async with await puller.pull() as w:
            assert w.version == 1 and w.verify()
            assert torch.equal(torch.from_numpy(w.buffer().copy()), flat)

        # a failure after a few tensors: an exception from the export, nothing committed
        seen: list[Failing] = []

        async def fail_midway(sink: VersionSink) -> None:
            seen.append(Failing(sink, good=3))
            await asyncio.to_thread(policy.export_into, seen[0])

        policy.train_step(TrainBatch.build(make_trajs(seed=2)))
        with pytest.raises(OSError, match="injected"):
            await pusher.push_stream(2, layout, fail_midway, digest=True)
        assert seen[0].seen == 4  # three tensors written, the fourth failed
        with pytest.raises(TimeoutError):  # no WeightsReady for version 2 comes
            await puller.wait_version(2, timeout=1.0)
        async with await puller.pull() as w:  # the newest is still the whole version 1
            assert w.version == 1 and w.verify()

        # the next version goes through (its staging replaces the failed one)
        flat3, _ = unstreamed(policy)
        await pusher.push_stream(3, layout, produce, digest=False)
        await puller.wait_version(3, timeout=10)
        async with await puller.pull() as w:
            assert w.version == 3 and w.verify()
            assert torch.equal(torch.from_numpy(w.buffer().copy()), flat3)
    finally:
        await puller.close()
        await pusher.close()

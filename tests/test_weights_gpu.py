"""GPU weight transports: torch.distributed broadcast (gloo on CPU here; NCCL on GPUs) and CUDA IPC.

    .venv/bin/python -m pytest tests/test_weights_gpu.py -q           # the gloo test
    .venv/bin/python -m pytest tests/test_weights_gpu.py -q -m gpu    # CUDA IPC / NCCL (needs GPUs)

Each test spawns its own worker processes (torch.multiprocessing, spawn) and joins them.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from laminar.weights.gpu import FlatWeights, pack_flat


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(300, 17, generator=g).to(torch.bfloat16).to(device),
        "b": torch.randn(33, generator=g).to(device),
        "n": torch.arange(10, device=device),
    }


def _broadcast_worker(rank: int, world: int, url: str, backend: str, q) -> None:
    from laminar.weights.gpu import WeightBroadcastGroup

    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = WeightBroadcastGroup(rank, world, url, backend=backend)
    device = group.device
    if rank == 0:
        q.put(("sent", group.send(3, _state(str(device)))))
    else:
        w = group.recv()
        got = dict(w.named_tensors())
        ok = all(torch.equal(got[k].cpu(), v) for k, v in _state().items()) and w.verify()
        q.put(("recv", (w.version, w.checksum, ok)))
    group.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_broadcast(backend: str, world: int) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    url = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(target=_broadcast_worker, args=(r, world, url, backend, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        out = [q.get(timeout=120) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    sent = [v for k, v in out if k == "sent"]
    recvd = [v for k, v in out if k == "recv"]
    assert len(sent) == 1 and len(recvd) == world - 1
    assert all(v == (3, sent[0], True) for v in recvd), out


def test_flat_pack_views_and_checksum_on_cpu():
    state = _state()
    layout, flat = pack_flat(state, "cpu")
    w = FlatWeights(1, "", layout, flat)
    got = dict(w.named_tensors())
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items())


def test_broadcast_group_with_gloo_delivers_bit_identical_versions():
    _run_broadcast("gloo", 2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs"
)
def test_broadcast_group_with_nccl():
    _run_broadcast("nccl", 2)


def _ipc_reader(msg_bytes: list[bytes], q) -> None:
    from laminar.transport.codec import decode
    from laminar.weights.gpu import open_cuda_ipc

    w = open_cuda_ipc(decode(msg_bytes))
    got = dict(w.named_tensors())
    ok = all(torch.equal(got[k].cpu(), v) for k, v in _state().items()) and w.verify()
    q.put((w.version, ok))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_handle_opens_in_another_process():
    from laminar.transport.codec import encode
    from laminar.weights.gpu import CudaIpcExporter

    exp = CudaIpcExporter(device="cuda:0", keep=2)
    msg = exp.export(5, _state("cuda:0"))
    frames = [bytes(f) for f in encode(msg)]  # what would travel over the relay's socket
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_reader, args=(frames, q))
    p.start()
    try:
        assert q.get(timeout=120) == (5, True)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    exp.release(5)

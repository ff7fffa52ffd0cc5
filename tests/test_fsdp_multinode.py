"""FSDP2 over gloo with its two ranks on two emulated hosts (`torchrun --nnodes 2`).

    .venv/bin/python -m pytest -m hosts tests/test_fsdp_multinode.py -q -s    # root

Host 0 and host 1 (tests/hosts.py: network namespaces on a private bridge) each run one
`torchrun --nnodes 2 --nproc_per_node 1 --node_rank R --master_addr <host 0> tests/fsdp_worker.py`:
the rendezvous and every gloo collective cross the bridge (GLOO_SOCKET_IFNAME=eth0; nothing
else is reachable from a namespace). The three steps, the gathered weights and the checkpoint
must match the same steps in one process here to 1e-5, as in tests/test_trainer_fsdp.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.hosts import Hosts

pytestmark = pytest.mark.hosts


ROOT = Path(__file__).resolve().parents[1]


def test_fsdp_ranks_on_two_hosts_match_one_process(tmp_path):
    from laminar.models.tiny import build_tiny_model
    from tests.test_trainer_fsdp import assert_matches_one_process

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not found next to this python")
    model = str(build_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=2, kv_heads=1))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    with Hosts(2) as hosts:
        procs = [
            hosts.popen(
                r,
                [
                    torchrun,
                    "--nnodes",
                    "2",
                    "--nproc_per_node",
                    "1",
                    "--node_rank",
                    str(r),
                    "--master_addr",
                    hosts.addr(0),
                    "--master_port",
                    "29511",
                    str(ROOT / "tests" / "fsdp_worker.py"),
                    model,
                    str(out),
                ],
                tmp_path / f"node{r}.log",
                env=env,
            )
            for r in (0, 1)
        ]
        t0 = time.monotonic()
        for p in procs:
            p.wait(timeout=max(1.0, 240 - (time.monotonic() - t0)))
        logs = "\n".join((tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1))
        assert [p.returncode for p in procs] == [0, 0], logs
    assert_matches_one_process(json.loads((out / "result.json").read_text()), out, model, tmp_path)

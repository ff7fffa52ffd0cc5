"""A real SLURM (Debian's slurm-wlm) runs launchers/slurm_laminar.sbatch with configs/slurm_cpu.yaml
through launchers/slurm_local.sh, on one node (this host) and on two nodes (each a network
namespace with its own address on a private bridge): the job completes (exit 0), and a job
cancelled mid-run with scancel leaves no process, /dev/shm segment, unix socket or ipc
directory behind. Root only (it installs packages and starts munged, slurmctld and slurmd).

    .venv/bin/python -m pytest tests/test_slurm.py -q -m slow
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launchers" / "slurm_local.sh"

pytestmark = pytest.mark.slow


def _state_dir(nodes: int) -> Path:
    default = "/tmp/laminar-slurm" if nodes == 1 else f"/tmp/laminar-slurm-n{nodes}"
    return Path(os.environ.get("SLURM_LOCAL_DIR", default))


def _running(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="module", params=[1, 2], ids=["1-node", "2-nodes-netns"])
def slurm(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    nodes = int(request.param)
    if os.geteuid() != 0:
        pytest.skip("needs root: installs slurm-wlm and starts munged, slurmctld, slurmd")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("slurm-wlm is not installed and there is no apt-get to install it")
    if nodes > 1 and not (shutil.which("ip") and shutil.which("nsenter")):
        pytest.skip("several nodes need network namespaces (ip, nsenter)")
    env = dict(
        os.environ, NODES=str(nodes), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    ours = not _running(_state_dir(nodes) / "slurmctld.pid")
    up = subprocess.run(
        ["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=900
    )
    if up.returncode != 0:
        if ours:
            subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"slurm_local.sh up failed:\n{up.stderr[-3000:]}")
    try:
        yield env
    finally:
        if ours:  # leave a SLURM someone else started running
            subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)


def test_job_completes_and_leaves_nothing(slurm: dict[str, str]) -> None:
    r = subprocess.run(
        ["bash", str(SCRIPT), "submit"], env=slurm, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "COMPLETED, exit code 0:0" in r.stderr
    assert "leftover check: no process" in r.stderr


def test_scancel_mid_run_leaves_nothing(slurm: dict[str, str]) -> None:
    r = subprocess.run(
        ["bash", str(SCRIPT), "cancel"], env=slurm, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "CANCELLED" in r.stderr
    assert "leftover check: no process" in r.stderr

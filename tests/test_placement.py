"""Engine placement per rollout (laminar/rollout/placement.py): a pure function of the index and
the host's resources, so two engines never share a core or a GPU by accident.

    .venv/bin/python -m pytest tests/test_placement.py -q
"""

from __future__ import annotations

import pytest

from laminar.rollout.placement import CPU_BIND, CUDA_DEVICES, derive_placement, host_placement


def test_two_rollouts_on_two_cores_get_one_core_each():
    # the failure in issue 19: vLLM's automatic binding put both engines on core 0
    a = derive_placement(0, 2, "cpu", cpus=[0, 1], gpus=0)
    b = derive_placement(1, 2, "cpu", cpus=[0, 1], gpus=0)
    assert (a.cores, b.cores) == ((0,), (1,))
    assert a.env == {CPU_BIND: "0"} and b.env == {CPU_BIND: "1"}
    assert not a.shared and not b.shared
    assert b.describe() == "rollout 1 of 2 on cpu: cores [1]"


@pytest.mark.parametrize("rollouts", [1, 2, 3, 4, 5, 8])
def test_cpu_slices_are_disjoint_and_cover_evenly(rollouts):
    cpus = [2, 3, 4, 5, 6, 7, 8, 9]  # an affinity mask that does not start at 0
    slices = [derive_placement(i, rollouts, "cpu", cpus, 0).cores for i in range(rollouts)]
    flat = [c for s in slices for c in s]
    assert len(flat) == len(set(flat)), slices  # no core twice
    assert set(flat) <= set(cpus)
    assert {len(s) for s in slices} == {len(cpus) // rollouts}


def test_cpu_ranges_syntax_and_index_wraps():
    p = derive_placement(1, 2, "cpu", cpus=[0, 1, 2, 3, 4, 5, 7, 8], gpus=0)
    assert p.cores == (4, 5, 7, 8) and p.env[CPU_BIND] == "4-5,7-8"
    # an index past the host's rollouts (another host's numbering) wraps onto a slice
    assert derive_placement(3, 2, "cpu", [0, 1], 0).cores == (1,)


def test_more_rollouts_than_cores_is_marked_shared():
    ps = [derive_placement(i, 3, "cpu", [0, 1], 0) for i in range(3)]
    assert [p.cores for p in ps] == [(0,), (1,), (0,)]
    assert all(p.shared for p in ps) and "shared" in ps[2].describe()


def test_gpus_dealt_per_rollout_with_tensor_parallel():
    assert [derive_placement(i, 4, "cuda", [0], 4).env[CUDA_DEVICES] for i in range(4)] == [
        "0",
        "1",
        "2",
        "3",
    ]
    tp2 = [derive_placement(i, 2, "cuda", [0], 4, gpus_per_rollout=2) for i in range(2)]
    assert [p.gpus for p in tp2] == [(0, 1), (2, 3)] and not any(p.shared for p in tp2)
    over = derive_placement(2, 3, "cuda", [0], 2)
    assert over.gpus == (0,) and over.shared


def test_environment_wins_and_errors_name_the_fix():
    kept = derive_placement(0, 2, "cpu", [0, 1], 0, env={CPU_BIND: "5"})
    assert kept.kept and kept.env == {CPU_BIND: "5"} and "environment" in kept.describe()
    kept = derive_placement(1, 2, "cuda", [0], 0, env={CUDA_DEVICES: "3"})
    assert kept.kept and kept.env == {CUDA_DEVICES: "3"}
    with pytest.raises(ValueError, match="no GPU"):
        derive_placement(0, 1, "cuda", [0], 0)
    with pytest.raises(ValueError, match="tensor_parallel"):
        derive_placement(0, 1, "cuda", [0], 2, gpus_per_rollout=4)
    with pytest.raises(ValueError, match="rollouts >= 1"):
        derive_placement(0, 0, "cpu", [0], 0)


def test_host_placement_uses_this_process_affinity(monkeypatch):
    import os

    monkeypatch.delenv(CPU_BIND, raising=False)
    mine = sorted(os.sched_getaffinity(0))
    p = host_placement(0, 1, "cpu")
    assert list(p.cores) == mine


def test_torch_rollouts_get_distinct_gpus_past_the_trainers():
    from laminar.rollout.placement import torch_device

    # 4 GPUs, the trainer on GPU 0: three rollouts on 1, 2, 3, none shared
    places = [derive_placement(i, 3, "cuda", [0], gpus=4, reserved=1) for i in range(3)]
    assert [torch_device(p, "cuda") for p in places] == ["cuda:1", "cuda:2", "cuda:3"]
    assert not any(p.shared for p in places)
    assert "gpus [2]" in places[1].describe()
    # 2 trainer GPUs on 8: rollouts from 2 up
    p = derive_placement(5, 6, "cuda", [0], gpus=8, reserved=2)
    assert torch_device(p, "cuda") == "cuda:7" and not p.shared


def test_one_gpu_is_shared_with_the_trainer_and_says_so():
    from laminar.rollout.placement import torch_device

    p = derive_placement(1, 2, "cuda", [0], gpus=1, reserved=1)
    assert torch_device(p, "cuda") == "cuda:0" and p.shared
    assert "shared" in p.describe()


def test_an_explicit_device_or_environment_wins_for_torch():
    from laminar.rollout.placement import torch_device

    p = derive_placement(1, 2, "cuda", [0], gpus=4, reserved=1)
    assert torch_device(p, "cuda:3") == "cuda:3"  # the user named one
    kept = derive_placement(1, 2, "cuda", [0], gpus=4, env={"CUDA_VISIBLE_DEVICES": "2"})
    assert torch_device(kept, "cuda") == "cuda"  # the launcher narrowed it: its cuda:0

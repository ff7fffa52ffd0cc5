"""Launchers: every script passes `bash -n` and shellcheck; slurm_laminar.sbatch and host_daemons.sh
dry-run against stand-in `srun`/`scontrol`/`squeue`/`scancel`/`torchrun`/`laminar` that record
their argv and environment (no SLURM, no model: shell stubs in a temporary PATH).

    .venv/bin/python -m pytest tests/test_launchers.py -q

What the dry runs pin: options before key=value overrides (`laminar node --role R [--index I]
--config F k=v ...`), one CUDA_VISIBLE_DEVICES per rollout process and none shared with the
trainer, cluster.roles.relay = the node count, --cpus-per-task on every step, a torchrun
rendezvous at the head node's NodeAddr with node rank 0 on the head, and the ordered stop
(trainer, rollouts, buffer, relays, manager) that leaves no stub running, when the trainer
finishes and on SIGTERM. A real SLURM run is tests/test_slurm.py (slow).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from laminar.engines.lifeline import alive

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ROOT / "launchers"
SCRIPTS = sorted([*LAUNCHERS.glob("*.sh"), *LAUNCHERS.glob("*.sbatch")])
SEP = "\x1f"

_REC = (
    r"""rec() { local line; line=$(printf '%s\x1f' "$@"); printf '%s\n' "$line" >> "$STUB_LOG"; }"""
)

# A node: records its start (pid, host, GPUs, torchrun node rank, argv), then runs until SIGTERM
# (recording the stop) or, when named in STUB_CRASH, exits 1 at once.
_LAMINAR = f"""#!/usr/bin/env bash
{_REC}
if [[ $1 == keys ]]; then mkdir -p "$2"; exit 0; fi
if [[ $1 == config ]]; then rec config "$$" "$@"; echo "${{STUB_CONFIG_VALUE:-3}}"; exit 0; fi
if [[ $1 == plan ]]; then rec plan "$$" "$@"; exit "${{STUB_PLAN_RC:-0}}"; fi
role=? index=0
args=("$@")
for ((i = 0; i < ${{#args[@]}}; i++)); do
  case ${{args[i]}} in --role) role=${{args[i+1]}};; --index) index=${{args[i+1]}};; esac
done
node=$role-$index
spid=
trap 'kill $spid 2>/dev/null; rec stop "$$" "$node"; exit 0' TERM
rec start "$$" "$node" "${{SLURMD_NODENAME:-}}" "${{CUDA_VISIBLE_DEVICES-unset}}" \
  "${{PET_NODE_RANK:-}}" "$0" "$@"
# once every expected node started (deadline 20 s)
if [[ " ${{STUB_CRASH:-}} " == *" $node "* ]]; then
  deadline=$((SECONDS + 20))
  while (( $(grep -c '^start' "$STUB_LOG") < STUB_EXPECT && SECONDS < deadline )); do
    sleep 0.05 & spid=$!; wait $spid
  done
  rec crash "$$" "$node"; exit 1
fi
sleep 60 & spid=$!
wait $spid
"""

# torchrun: records like a node; the trainer then waits (deadline 20 s) until STUB_EXPECT nodes
# started, and exits STUB_TRAINER_RC, or with STUB_TRAINER_HOLD runs until SIGTERM.
_TORCHRUN = f"""#!/usr/bin/env bash
{_REC}
node=trainer-${{PET_NODE_RANK:-0}}
spid=
trap 'kill $spid 2>/dev/null; rec stop "$$" "$node"; exit 0' TERM
rec start "$$" "$node" "${{SLURMD_NODENAME:-}}" "${{CUDA_VISIBLE_DEVICES-unset}}" \
  "${{PET_NODE_RANK:-}}" "$0" "$@"
deadline=$((SECONDS + 20))
while (( $(grep -c '^start' "$STUB_LOG") < STUB_EXPECT && SECONDS < deadline )); do
  sleep 0.05 & spid=$!; wait $spid
done
if [[ -n ${{STUB_TRAINER_HOLD:-}} ]]; then sleep 60 & spid=$!; wait $spid; fi
rec done "$$" "$node"
exit "${{STUB_TRAINER_RC:-0}}"
"""

# srun: records its argv and the step, then runs one task per node of --nodelist
# (SLURM_NODEID, SLURMD_NODENAME set); with one node the task replaces this process.
_SRUN = f"""#!/usr/bin/env bash
{_REC}
rec srun "$$" "$@"
nodes=1 nodelist= name=
while [[ $1 == --* ]]; do
  case $1 in
    --nodes=*) nodes=${{1#*=}};; --nodelist=*) nodelist=${{1#*=}};; --job-name=*) name=${{1#*=}};;
  esac
  shift
done
echo "$name $$" >> "$STUB_DIR/steps"
if (( nodes == 1 )); then SLURM_NODEID=0 SLURMD_NODENAME=$nodelist exec "$@"; fi
IFS=, read -r -a hosts <<< "$nodelist"
pids=()
trap 'kill -TERM "${{pids[@]}}" 2>/dev/null' TERM
for i in "${{!hosts[@]}}"; do SLURM_NODEID=$i SLURMD_NODENAME=${{hosts[$i]}} "$@" & pids+=($!); done
rc=0
for p in "${{pids[@]}}"; do
  while :; do wait "$p"; r=$?; kill -0 "$p" 2>/dev/null || break; done
  (( r > rc )) && rc=$r
done
exit $rc
"""

# scontrol: hostnames of a comma list; node nK has NodeAddr 10.9.0.(K+1)
_SCONTROL = """#!/usr/bin/env bash
if [[ $1 == show && $2 == hostnames ]]; then tr , '\\n' <<< "$3"; exit 0; fi
if [[ $1 == show && $2 == node ]]; then
  h=${@: -1}
  echo "NodeName=$h Arch=x86_64 NodeAddr=10.9.0.$(( ${h#n} + 1 )) NodeHostName=$h"; exit 0
fi
exit 1
"""

# squeue/scancel: steps are the lines of $STUB_DIR/steps ("name pid"), step id JOB.LINE-1
_SQUEUE = """#!/usr/bin/env bash
n=0
while read -r name pid; do
  kill -0 "$pid" 2>/dev/null && echo "$SLURM_JOB_ID.$n $name"
  n=$((n + 1))
done < "$STUB_DIR/steps"
"""
_SCANCEL = f"""#!/usr/bin/env bash
{_REC}
sig=TERM
for a in "$@"; do case $a in --signal=*) sig=${{a#*=}};; *.*) id=${{a#*.}};; esac; done
pid=$(sed -n "$((id + 1))p" "$STUB_DIR/steps" | awk '{{print $2}}')
rec scancel "$$" "$sig" "$id"
kill -"$sig" "$pid"
"""


@dataclass
class Rec:
    kind: str
    pid: int
    fields: list[str]

    @property
    def node(self) -> str:
        return self.fields[0]


def _records(log: Path) -> list[Rec]:
    out = []
    for line in log.read_text().splitlines():
        parts = line.split(SEP)
        if parts and parts[-1] == "":
            parts = parts[:-1]
        out.append(Rec(parts[0], int(parts[1]), parts[2:]))
    return out


def _stubs(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in {
        "laminar": _LAMINAR,
        "torchrun": _TORCHRUN,
        "srun": _SRUN,
        "scontrol": _SCONTROL,
        "squeue": _SQUEUE,
        "scancel": _SCANCEL,
    }.items():
        p = bin_dir / name
        p.write_text(text)
        p.chmod(0o755)
    (tmp / "steps").touch()
    (tmp / "log").touch()
    return bin_dir


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    bin_dir = _stubs(tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_", "PET_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        STUB_LOG=str(tmp / "log"),
        STUB_DIR=str(tmp),
        LAMINAR=str(bin_dir / "laminar"),
        TORCHRUN=str(bin_dir / "torchrun"),
        LAUNCHERS=str(LAUNCHERS),
        RUN_DIR=str(tmp / "run"),
        STOP_TIMEOUT_S="10",
        GPU_MEM_GIB="80",
    )
    env.update(extra)
    return env


def _wait_for(cond, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _after_config(argv: list[str]) -> list[str]:
    i = argv.index("--config")
    return argv[i + 2 :]


def _sbatch(tmp: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(LAUNCHERS / "slurm_laminar.sbatch"), "configs/x.yaml", *overrides],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _stop_order(recs: list[Rec]) -> list[str]:
    roles = []
    for r in recs:
        if r.kind == "stop":
            role = r.node.rsplit("-", 1)[0]
            if not roles or roles[-1] != role:
                roles.append(role)
    return roles


# ---- static checks ------------------------------------------------------------------


def test_every_launcher_script_is_checked() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"slurm_laminar.sbatch", "host_daemons.sh", "on_gpus.sh", "slurm_local.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bash_n(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_shellcheck(script: Path) -> None:
    sc = shutil.which("shellcheck")
    if sc is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    r = subprocess.run([sc, "-s", "bash", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- slurm_laminar.sbatch -----------------------------------------------------------


def test_sbatch_two_gpu_nodes_order_gpus_relays_and_cleanup(tmp_path: Path) -> None:
    # 2 nodes x 8 GPUs: the trainer takes GPUs 0-3 of n0; rollouts get 4-7 on n0 and 0-7 on n1
    env = _env(
        tmp_path,
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="n0,n1",
        SLURM_GPUS_PER_NODE="h100:8",
        SLURM_CPUS_ON_NODE="16",
        STUB_EXPECT=str(2 + 2 + 12 + 1),
    )
    r = _sbatch(tmp_path, env)  # no overrides: an empty OVERRIDES under set -u
    assert r.returncode == 0, r.stderr
    recs = _records(tmp_path / "log")
    starts = [x for x in recs if x.kind == "start"]
    by_node = {x.node: x for x in starts}
    assert sorted(by_node) == sorted(
        ["manager-0", "buffer-0", "relay-0", "relay-1", "trainer-0"]
        + [f"rollout-{i}" for i in range(12)]
    )
    # the memory plan ran first, for these GPUs and this trainer
    (plan,) = [x for x in recs if x.kind == "plan"]
    assert plan.fields[plan.fields.index("--gpu-mem") + 1] == "80"
    assert plan.fields[plan.fields.index("--trainer-gpus") + 1] == "4"
    assert plan.fields[plan.fields.index("--gpus-per-node") + 1] == "8"
    # one step on every node checked the run directory is shared
    sruns = [x for x in recs if x.kind == "srun"]
    (check,) = [x for x in sruns if "--job-name=laminar-fscheck" in x.fields]
    assert "--nodes=2" in check.fields
    sruns.remove(check)
    # every srun: overlapping step, the node's CPUs, one task per node
    assert len(sruns) == 17
    for s in sruns:
        assert "--overlap" in s.fields and "--cpus-per-task=16" in s.fields, s.fields
    # options, then --config F, then only key=value; the process's own override last
    for x in starts:
        argv = x.fields[5:]
        if x.node.startswith("trainer"):
            assert argv[argv.index("-m") : argv.index("-m") + 5] == [
                "-m",
                "laminar",
                "node",
                "--role",
                "trainer",
            ]
        tail = _after_config(argv)
        assert tail and all("=" in a and not a.startswith("-") for a in tail), argv
        assert "cluster.roles.relay=2" in tail and "cluster.roles.rollout=12" in tail
        assert "cluster.transport=tcp" in tail
        endpoints = next(a for a in tail if a.startswith("cluster.endpoints="))
        assert "relay-1: 'tcp://10.9.0.2:15561'" in endpoints
        assert "manager: 'tcp://10.9.0.1:15550'" in endpoints
    # hosts: head services on n0, relay i on node i, rollouts reading their own node's relay
    for node in ("manager-0", "buffer-0", "relay-0", "trainer-0"):
        assert by_node[node].fields[1] == "n0"
    assert by_node["relay-1"].fields[1] == "n1"
    gpus: dict[str, set[str]] = {"n0": set(), "n1": set()}
    for i in range(12):
        x = by_node[f"rollout-{i}"]
        host, cuda = x.fields[1], x.fields[2]
        assert _after_config(x.fields[5:])[-1] == f"rollout.relay_index={host[1]}"
        assert cuda.isdigit(), f"rollout-{i}: one GPU, got {cuda!r}"
        assert cuda not in gpus[host], f"GPU {cuda} on {host} given twice"
        gpus[host].add(cuda)
    trainer = by_node["trainer-0"]
    assert trainer.fields[2] == "0,1,2,3" and trainer.fields[3] == "0"
    assert gpus["n0"] == {"4", "5", "6", "7"} and gpus["n1"] == {str(g) for g in range(8)}
    targv = trainer.fields[5:]
    assert targv[targv.index("--nnodes") + 1] == "1"
    assert targv[targv.index("--nproc_per_node") + 1] == "4"
    assert targv[targv.index("--master_addr") + 1] == "10.9.0.1"  # the head's NodeAddr
    assert "--standalone" not in targv
    # the trainer finished: every other node stopped, in order, and nothing is left running
    assert _stop_order(recs) == ["rollout", "buffer", "relay", "manager"]
    assert {x.node for x in recs if x.kind == "stop"} == set(by_node) - {"trainer-0"}
    assert all(x.fields[0] == "TERM" for x in recs if x.kind == "scancel")
    assert not [x.pid for x in starts if alive(x.pid)]


def test_sbatch_multi_node_trainer_rendezvous_on_the_head(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        SLURM_JOB_ID="78",
        SLURM_JOB_NODELIST="n0,n1,n2",
        SLURM_GPUS_PER_NODE="8",
        SLURM_CPUS_ON_NODE="8",
        TRAINER_NODES="2",
        TRAINER_GPUS="8",
        STUB_EXPECT=str(2 + 3 + 8 + 2),
    )
    r = _sbatch(tmp_path, env, "trainer.total_steps=3")
    assert r.returncode == 0, r.stderr
    recs = _records(tmp_path / "log")
    trainers = sorted(
        (x for x in recs if x.kind == "start" and x.node.startswith("trainer")),
        key=lambda x: x.node,
    )
    assert [(t.fields[1], t.fields[3]) for t in trainers] == [("n0", "0"), ("n1", "1")]
    for t in trainers:
        argv = t.fields[5:]
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--master_addr") + 1] == "10.9.0.1"
        assert t.fields[2] == "0,1,2,3,4,5,6,7"
        assert _after_config(argv)[-1] == "trainer.total_steps=3"  # the user's overrides come last
    trainer_srun = next(x for x in recs if x.kind == "srun" and "torchrun" in " ".join(x.fields))
    assert "--nodes=2" in trainer_srun.fields and "--nodelist=n0,n1" in trainer_srun.fields
    rollouts = [x for x in recs if x.kind == "start" and x.node.startswith("rollout")]
    assert sorted(x.fields[1] for x in rollouts) == ["n2"] * 8  # n0 and n1 belong to the trainer
    assert not [x.pid for x in recs if x.kind == "start" and alive(x.pid)]


def test_sbatch_cpu_nodes_hide_gpus(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        SLURM_JOB_ID="79",
        SLURM_JOB_NODELIST="n0",
        SLURM_GPUS_PER_NODE="0",
        ROLLOUTS_PER_NODE="2",
        STUB_EXPECT=str(2 + 1 + 2 + 1),
    )
    r = _sbatch(tmp_path, env)
    assert r.returncode == 0, r.stderr
    starts = [x for x in _records(tmp_path / "log") if x.kind == "start"]
    rollouts = [x for x in starts if x.node.startswith("rollout")]
    assert len(rollouts) == 2 and all(x.fields[2] == "" for x in rollouts)
    trainer = next(x for x in starts if x.node.startswith("trainer"))
    argv = trainer.fields[5:]
    assert argv[argv.index("--nproc_per_node") + 1] == "1" and trainer.fields[2] == ""


def test_sbatch_sigterm_stops_everything_trainer_first(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        SLURM_JOB_ID="80",
        SLURM_JOB_NODELIST="n0,n1",
        SLURM_GPUS_PER_NODE="2",
        TRAINER_GPUS="1",
        STUB_EXPECT="1000",
        STUB_TRAINER_HOLD="1",
    )
    proc = subprocess.Popen(
        ["bash", str(LAUNCHERS / "slurm_laminar.sbatch"), "configs/x.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = tmp_path / "log"
        # manager, buffer, 2 relays, 1 + 2 rollouts, trainer
        _wait_for(lambda: log.read_text().count("start" + SEP) == 8, "every node to start")
        proc.send_signal(signal.SIGTERM)  # what scancel does to the batch script
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    recs = _records(tmp_path / "log")
    assert _stop_order(recs) == ["trainer", "rollout", "buffer", "relay", "manager"]
    starts = [x for x in recs if x.kind == "start"]
    assert {x.node for x in recs if x.kind == "stop"} == {x.node for x in starts}
    assert not [x.pid for x in starts if alive(x.pid)]


def test_sbatch_refuses_more_rollouts_than_gpus(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        SLURM_JOB_ID="81",
        SLURM_JOB_NODELIST="n0",
        SLURM_GPUS_PER_NODE="8",
        ROLLOUTS_PER_NODE="8",
        STUB_EXPECT="0",
    )
    r = _sbatch(tmp_path, env)
    assert r.returncode == 2
    assert "8 rollouts x 1 GPU(s) + 4 trainer GPU(s) > GPUS_PER_NODE=8" in r.stderr
    assert not [x for x in _records(tmp_path / "log") if x.kind in ("srun", "start")]


# ---- host_daemons.sh ----------------------------------------------------------------


def _host_daemons(tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(LAUNCHERS / "host_daemons.sh"), "configs/x.yaml", "trainer.lr=1e-6"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_host_daemons_tcp_endpoints_and_gpus(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        HOST_INDEX="1",
        HOST_IPS="10.0.0.1,10.0.0.2",
        GPUS="4",
        KEYS_DIR="/k",
        STUB_EXPECT="5",
        STUB_CRASH="rollout-7",
        MAX_RESTARTS="0",
    )
    r = _host_daemons(tmp_path, env)
    assert r.returncode == 1, r.stderr  # rollout-7 died with no restart budget: the host stops
    recs = _records(tmp_path / "log")
    starts = {x.node: x for x in recs if x.kind == "start"}
    assert sorted(starts) == ["relay-1", "rollout-4", "rollout-5", "rollout-6", "rollout-7"]
    assert sorted(starts[f"rollout-{i}"].fields[2] for i in range(4, 8)) == ["0", "1", "2", "3"]
    for x in starts.values():
        tail = _after_config(x.fields[5:])
        assert all("=" in a for a in tail)
        assert "cluster.roles.relay=2" in tail and "security.keys_dir=/k" in tail
        eps = next(a for a in tail if a.startswith("cluster.endpoints="))
        assert "manager: 'tcp://10.0.0.1:15550'" in eps and "relay-1: 'tcp://10.0.0.2:15561'" in eps
        if x.node.startswith("rollout"):
            assert tail[-1] == "rollout.relay_index=1" and tail[-2] == "trainer.lr=1e-6"
    # one node died: every sibling was stopped, none is left running
    assert {x.node for x in recs if x.kind == "stop"} == set(starts) - {"rollout-7"}
    assert not [x.pid for x in starts.values() if alive(x.pid)]


def test_host_daemons_head_ip_needs_host_ips(tmp_path: Path) -> None:
    env = _env(tmp_path, HOST_INDEX="0", HEAD_IP="10.0.0.1", STUB_EXPECT="0")
    r = _host_daemons(tmp_path, env)
    assert r.returncode == 2 and "HOST_IPS" in r.stderr


def test_sbatch_refuses_a_config_the_plan_says_does_not_fit(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        SLURM_JOB_ID="81",
        SLURM_JOB_NODELIST="n0",
        SLURM_GPUS_PER_NODE="8",
        STUB_EXPECT="1",
        STUB_PLAN_RC="1",
    )
    r = _sbatch(tmp_path, env, "trainer.micro_batch_tokens=131072")
    assert r.returncode == 2
    assert "does not fit" in r.stderr
    recs = _records(tmp_path / "log")
    (plan,) = [x for x in recs if x.kind == "plan"]
    assert plan.fields[-1] == "trainer.micro_batch_tokens=131072"
    assert not [x for x in recs if x.kind == "start"]  # nothing started

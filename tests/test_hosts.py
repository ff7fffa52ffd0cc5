"""A laminar job across emulated hosts: network namespaces, tcp + CURVE, host-level faults.

    .venv/bin/python -m pytest -m hosts tests/test_hosts.py -q -s      # root; skipped otherwise

4 hosts (tests/hosts.py: one network namespace each, on a private bridge), 2 sim rollouts per
host. Host 0 runs manager, buffer, the sim trainer, relay-0 and its rollouts; host i runs relay-i
and rollouts 2i, 2i+1 (one `laminar node --role rollout --count 2` process, as
launchers/host_daemons.sh starts them). Every socket is tcp with CURVE (keys from `laminar keys
--roles ...`); every rollout reads its own host's relay (rollout.relay_index=i). The job is one
epoch of P prompts; the trainer ends on its own when the data runs out. Then, from the files the
nodes wrote: every prompt consumed exactly once as a whole group, the buffer journal clean, every
relay got every version, and each host's rollouts loaded weights only through their own relay
(their only TCP peers on relay ports are their own host's address, read with `ss` in the
namespace mid-run).

Faults: kill every process of host 3 (relay included) mid-run; partition host 2 for 10 s (its
bridge port down); a 10x slower link on one relay. Detection and resume times are printed.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from laminar.config import load_config
from laminar.weights.segment import default_shm_dir
from tests.hosts import Hosts, make_keys, node_cmd, tcp_endpoints
from tests.sim_cluster import read_jsonl, write_prompts

pytestmark = pytest.mark.hosts


K = 4
PER_HOST = 2
GROUP = 2
DEADLINE_S = 110.0


class HostCluster:
    """The nodes of one test across K hosts; only these pids are ever signalled."""

    def __init__(self, tmp: Path, hosts: Hosts, prompts: int = 48, **extra: dict):
        self.tmp, self.hosts, self.prompts = tmp, hosts, prompts
        cfg = {
            "name": "hosts",
            "mode": "laminar",
            "run_dir": str(tmp / "run"),
            "cluster": {
                "transport": "tcp",
                "endpoints": tcp_endpoints(hosts, K),
                "roles": {
                    "manager": 1,
                    "buffer": 1,
                    "relay": K,
                    "trainer": 1,
                    "rollout": K * PER_HOST,
                },
            },
            "security": {"keys_dir": str(make_keys(tmp / "keys"))},
            "transport": {
                "heartbeat_interval_s": 0.25,
                "heartbeat_liveness": 12,
                "request_timeout_s": 3.0,
                "handshake_timeout_s": 3.0,
                "startup_timeout_s": 90.0,
                "stop_timeout_s": 3.0,
                "reconnect_backoff_s": 0.05,
                "reconnect_backoff_max_s": 0.5,
            },
            "data": {
                "train": str(write_prompts(tmp / "prompts.jsonl", prompts)),
                "epochs": 1,
                "shuffle": False,
            },
            "rollout": {
                "engine": "sim",
                "weights": "relay",
                "group_size": GROUP,
                "credits": 2,
                "max_running": 8,
                "partial_chunk_tokens": 16,
                "prompt_retry_s": 0.1,
                "refresh_wait_s": 2.0,
                "sampling": {"max_tokens": 600},
                "sim": {
                    "step_time_s": 0.01,
                    "bound_b": 8,
                    "length_p50": 60,
                    "length_p99_over_p50": 10,
                    "kv_capacity_tokens": 8 * 700,
                },
            },
            "trainer": {
                "engine": "sim",
                "batch_groups": 4,
                "total_steps": 1000,
                "sim_time_per_token_s": 2e-4,
                "sim_weight_bytes": 256 << 10,  # 4 chunks a version through the chain
                "checkpoint_every": 1,
                "commit": "checkpoint",
                "batch_wait_s": 0.5,
            },
            "relay": {
                "chunk_bytes": 64 << 10,
                "shm_prefix": f"lamh{hosts.names[0][3:]}",
                "probe_timeout_s": 1.0,
                "upstream_grace_s": 10.0,
            },
            "buffer": {"fsync": "always", "retry_after_s": 0.1},
            "manager": {"repack": {"interval_s": 1.0}, "timeline_interval_s": 0.25},
            "logging": {"level": "info", "json_logs": True},
        }
        for section, over in extra.items():
            cfg.setdefault(section, {}).update(over)
        self.cfg_path = tmp / "config.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.cfg = load_config(self.cfg_path)
        self.run_dir = Path(cfg["run_dir"])
        self.procs: dict[str, subprocess.Popen] = {}
        self.host_of: dict[str, int] = {}
        self.n_logs = 0

    # ---- processes ---------------------------------------------------------------------------
    def start(
        self, name: str, host: int, role: str, index: int = 0, count: int = 1, *over: str
    ) -> None:
        self.n_logs += 1
        log = self.tmp / f"{name}.{self.n_logs}.log"
        self.procs[name] = self.hosts.popen(
            host, node_cmd(role, self.cfg_path, index, count, *over), log
        )
        self.host_of[name] = host

    def start_host(self, i: int) -> None:
        if i == 0:
            self.start("manager", 0, "manager")
            self.start("buffer", 0, "buffer")
        self.start(f"relay-{i}", i, "relay", i)
        self.start(
            f"rollouts-{i}", i, "rollout", i * PER_HOST, PER_HOST, f"rollout.relay_index={i}"
        )
        if i == 0:
            self.start("trainer", 0, "trainer")

    def start_all(self) -> None:
        for i in range(K):
            self.start_host(i)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # segments of a relay killed with its host (a clean stop removes its own)
        shm = Path(self.cfg.relay.shm_dir or default_shm_dir())
        for f in shm.glob(f"{self.cfg.relay.shm_prefix}-*"):
            f.unlink(missing_ok=True)

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}"
            for f in sorted(self.tmp.glob("*.log"))
        )

    def events(self, name_glob: str, event: str) -> list[dict]:
        """JSON log lines with this event name from the logs of processes matching `name_glob`."""
        out = []
        for f in sorted(self.tmp.glob(f"{name_glob}.*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if f'"{event}"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("event") == event:
                    out.append(rec)
        return out

    # ---- what the nodes wrote ----------------------------------------------------------------
    def timeline(self, kind: str | None = None, node: str | None = None) -> list[dict]:
        evs = read_jsonl(self.run_dir / "timeline.jsonl")
        return [
            e
            for e in evs
            if (kind is None or e["event"] == kind)
            and (node is None or e.get("node", e.get("rollout")) == node)
        ]

    def steps(self) -> list[dict]:
        return read_jsonl(self.run_dir / "consumed.jsonl")

    def wait(
        self, cond, what: str, timeout: float = DEADLINE_S, every: float = 0.2, allow: tuple = ()
    ):
        """Poll files the nodes write against a deadline (no event crosses the processes)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if name not in allow and p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited with {p.returncode}\n{self.logs()}")
            try:
                value = cond()
            except (OSError, ValueError, KeyError):  # a file mid-write
                value = None
            if value:
                return value
            time.sleep(every)  # polling files; no event to wait on across processes
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def wait_registered(self) -> None:
        want = {f"rollout-{i}" for i in range(K * PER_HOST)} | {f"relay-{i}" for i in range(K)}
        want |= {"buffer-0", "trainer-0"}
        self.wait(
            lambda: want <= {e["node"] for e in self.timeline("join")}, "every node registered"
        )

    def wait_trainer_done(self) -> None:
        self.wait(lambda: self.procs["trainer"].poll() == 0, "the trainer finishing the epoch")

    def check_exactly_once(self) -> int:
        """Every prompt consumed once as a whole group; the journal agrees. Returns the steps."""
        last: dict[int, dict] = {}
        for rec in self.steps():
            last[rec["step"]] = rec
        uids = [u for rec in last.values() for u in rec["uids"]]
        dup = [u for u, c in Counter(uids).items() if c > 1]
        assert not dup, f"consumed twice: {dup[:5]}"
        groups = Counter(u.rpartition("/")[0] for u in uids)
        assert set(groups.values()) == {GROUP}, "a consumed group was not whole"
        prompts = Counter(g.split("@")[0] for g in groups)
        assert len(prompts) == self.prompts and set(prompts.values()) == {1}, (
            "a prompt lost or doubled"
        )
        self._check_journal(len(groups))
        return len(last)

    def _check_journal(self, n_groups: int) -> None:
        from laminar.journal_check import replay_buffer_journal
        from laminar.wiring.buffer import experience_state

        journal = self.run_dir / "buffer-0.journal"
        s = replay_buffer_journal(journal, experience_state(self.cfg))[0].summary()
        assert s["held"] == 0 and s["pending"] == 0 and s["outstanding_batches"] == 0, s
        assert s.get("groups_committed") == n_groups and not s.get("groups_dropped"), s
        assert not s.get("abandoned"), s

    def versions_ready(self, relay: int) -> list[int]:
        return [e["version"] for e in self.events(f"relay-{relay}", "version_ready")]

    def loaded(self, host: int) -> list[tuple[str, int]]:
        return [
            (e.get("node_id", "?"), e["version"])
            for e in self.events(f"rollouts-{host}", "weights_loaded")
        ]

    def relay_peers(self, host: int) -> set[str]:
        """Addresses the host's rollout process has TCP connections to on relay ports (ss -tnp)."""
        pid = self.procs[f"rollouts-{host}"].pid
        out = self.hosts.run(host, ["ss", "-Htnp", "state", "established"]).stdout
        peers = set()
        relay_ports = {
            int(ep.rsplit(":", 1)[1])
            for k, ep in self.cfg.cluster.endpoints.items()
            if k.startswith(("relay-", "relay_pub-"))
        }
        for line in out.splitlines():
            if f"pid={pid}," not in line:
                continue
            cols = line.split()
            addr, port = cols[3].rsplit(":", 1)  # Recv-Q Send-Q Local Peer Process
            if int(port) in relay_ports:
                peers.add(addr)
        return peers


@pytest.fixture
def hosts():
    with Hosts(K) as h:
        yield h


@pytest.fixture
def cluster(tmp_path, hosts):
    c = HostCluster(tmp_path, hosts)
    yield c
    c.stop_all()


@pytest.fixture
def long_cluster(tmp_path, hosts):
    """A job long enough (~1 min of training) to hurt a host mid-run and see it back."""
    c = HostCluster(tmp_path, hosts, prompts=160, trainer={"sim_time_per_token_s": 1.5e-3})
    yield c
    c.stop_all()


def _summary(c: HostCluster) -> str:
    return " ".join(f"relay-{i}:{len(c.versions_ready(i))}" for i in range(K))


def test_job_across_4_hosts_every_rollout_pulls_from_its_own_relay(cluster):
    c = cluster
    t0 = time.time()
    c.start_all()
    c.wait_registered()
    c.wait(lambda: len(c.steps()) >= 2, "two training steps")
    peers = {i: c.relay_peers(i) for i in range(K)}  # mid-run: the rollouts' live connections
    c.wait_trainer_done()
    elapsed = time.time() - t0
    c.stop_all()
    steps = c.check_exactly_once()
    pushed = sorted({e["version"] for e in c.events("relay-0", "version_ready")})
    print(
        f"\n{K} hosts x {PER_HOST} rollouts: {steps} steps in {elapsed:.1f}s; versions {pushed}; "
        f"{_summary(c)}"
    )
    assert len(pushed) >= steps  # the master got every version the trainer pushed
    for i in range(K):
        assert peers[i] == {c.hosts.addr(i)}, f"host {i}'s rollouts read relays at {peers[i]}"
        got = set(c.versions_ready(i))
        assert set(pushed) <= got, f"relay-{i} missed versions {set(pushed) - got}"
        loaded = c.loaded(i)
        # a rollout pulls the newest version whenever it is idle, never on a schedule: it may skip
        # versions that came and went while it was busy, so the check is per host, not per version
        mine = {f"rollout-{r}" for r in range(i * PER_HOST, (i + 1) * PER_HOST)}
        assert loaded and {n for n, _ in loaded} <= mine, loaded
        assert {v for _, v in loaded} <= got  # every load is a version this host's relay had
        print(
            f"  host {i}: relay peers {sorted(peers[i])}, rollouts loaded "
            f"{sorted(Counter(v for _, v in loaded).items())}"
        )


def test_killed_host_work_resumes_elsewhere_and_chain_heals(long_cluster):
    c = long_cluster
    c.start_all()
    c.wait_registered()
    victims = [f"rollout-{r}" for r in range(3 * PER_HOST, 4 * PER_HOST)]
    c.wait(
        lambda: (
            len(c.steps()) >= 2
            and any(e["inflight"] for v in victims for e in c.timeline("rollout", v)[-1:])
        ),
        "training under way, host 3 generating",
    )
    before = max(c.versions_ready(0), default=-1)
    t_kill = c.hosts.kill_host(3)
    dead = c.wait(
        lambda: (
            all(c.timeline("dead", n) for n in [*victims, "relay-3"])
            and {n: c.timeline("dead", n)[0]["t"] for n in [*victims, "relay-3"]}
        ),
        "host 3's nodes declared dead",
        20,
    )
    recs = c.wait(
        lambda: (
            all(c.timeline("recovery", v) for v in victims)
            and [c.timeline("recovery", v)[0] for v in victims]
        ),
        "recovery of host 3's work",
        20,
    )
    # partials whose version no live rollout holds wait as orphans and are placed again every
    # second (manager recovery loop); the exactly-once check at the end says none was lost
    assert sum(r["trajectories"] for r in recs) >= 1, recs
    # the chain heals: a version pushed after the kill reaches every surviving relay
    c.wait(
        lambda: all(max(c.versions_ready(i), default=-1) > before + 1 for i in range(3)),
        "a new version on relays 0-2 after the kill",
        60,
    )
    c.wait_trainer_done()
    c.stop_all()
    c.check_exactly_once()
    detect = {n: round(t - t_kill, 2) for n, t in dead.items()}
    resume = {r["rollout"]: round(r["t"] - t_kill, 2) for r in recs}
    print(
        f"\nhost kill: detected {detect}; resumed {resume} (trajectories "
        f"{[r['trajectories'] for r in recs]}, orphans first {[r['orphans'] for r in recs]}); "
        f"{_summary(c)}"
    )
    assert max(detect.values()) <= 8.0


def test_partitioned_host_is_declared_dead_and_rejoins_without_duplicates(long_cluster):
    c = long_cluster
    c.start_all()
    c.wait_registered()
    members = [f"rollout-{r}" for r in range(2 * PER_HOST, 3 * PER_HOST)] + ["relay-2"]
    c.wait(lambda: len(c.steps()) >= 2, "training under way")
    t_cut = c.hosts.partition(2)
    dead = c.wait(
        lambda: (
            all(c.timeline("dead", n) for n in members)
            and {n: c.timeline("dead", n)[0]["t"] for n in members}
        ),
        "host 2 declared dead",
        20,
    )
    # a 10 s partition, measured from the cut: the wait is the scenario, not a synchronisation
    time.sleep(max(0.0, t_cut + 10.0 - time.time()))
    t_heal = c.hosts.heal(2)
    back = c.wait(
        lambda: (
            all([e for e in c.timeline("join", n) if e["t"] > t_heal] for n in members)
            and {n: [e for e in c.timeline("join", n) if e["t"] > t_heal][0]["t"] for n in members}
        ),
        "host 2's nodes rejoining",
        40,
    )
    c.wait_trainer_done()
    c.stop_all()
    c.check_exactly_once()
    detect = {n: round(t - t_cut, 2) for n, t in dead.items()}
    rejoin = {n: round(t - t_heal, 2) for n, t in back.items()}
    print(f"\npartition 10 s: detected {detect}; rejoined after heal {rejoin}; {_summary(c)}")
    assert max(detect.values()) <= 8.0
    assert re.search(r"relay-2:\d", _summary(c))


def test_a_straggler_relay_link_does_not_slow_the_relays_behind_it(tmp_path):
    """Relay 1 of 4 on a link 10x slower than the others (after one healthy version): with the
    manager's order (chain_order.py: the straggler last) the other relays get each version at
    their own links' speed; with the chain forced into index order they wait for relay 1."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from weights_hosts import run_cluster

    rate = 200e6 / 8  # 25 MB/s links, relay 1 at 2.5 MB/s
    res = run_cluster(tmp_path, 4, rate, 8 << 20, 1, 1, print)
    fixed, forced = res["straggler_reordered"], res["straggler_index_order"]
    print(
        "\nstraggler relay-1 (8 MB, 25 vs 2.5 MB/s): other relays "
        f"{fixed['fast_relays_s']['median']:.2f}s with the manager's order {fixed['order']}, "
        f"{forced['fast_relays_s']['median']:.2f}s in index order {forced['order']}; all relays "
        f"{fixed['all_relays_s']['median']:.2f}s / {forced['all_relays_s']['median']:.2f}s"
    )
    assert fixed["order"][-1] == 1 and forced["order"] == [0, 1, 2, 3]
    assert fixed["fast_relays_s"]["median"] * 3 < forced["fast_relays_s"]["median"]

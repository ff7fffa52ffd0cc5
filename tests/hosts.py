"""Emulated hosts on real network stacks: K Linux network namespaces on a private bridge.

    with Hosts(4) as hosts:                         # root only; Hosts.unavailable() says why not
        hosts.shape(2, rate_bytes_s=20e6)            # host 2's link: 20 MB/s each way (tbf)
        p = hosts.popen(0, ["python", "-m", "laminar", ...], log_path)   # ip netns exec lamNh0 ...
        hosts.addr(1)                                # "10.a.b.2": host 1's only address
        hosts.partition(3); hosts.heal(3)            # host 3's link down / up (100% loss)
        hosts.kill_host(1)                           # SIGKILL every process in host 1's namespace

    namespace lam<pid>x<n>b (made here)            namespaces lam<pid>x<n>h<i>
    ┌───────────────────────────────┐      ┌──────────────────────────────┐
    │  br0 ── p0 ════ veth ═════════╪══════╪═ eth0 10.a.b.1/24  (+ lo)    │  host 0
    │      ── p1 ════ veth ═════════╪══════╪═ eth0 10.a.b.2/24            │  host 1 ...
    └───────────────────────────────┘      └──────────────────────────────┘

Nothing is added to the root namespace: the bridge lives in a namespace of its own, each host's
address exists only on the eth0 inside that host's namespace, and no namespace has a default
route, so nothing routes anywhere but between the hosts. Each link is shaped on both ends
(tbf on eth0's egress: host -> bridge; tbf on the bridge port's egress: bridge -> host), so a
host's rate limits what it sends and what it receives. Delay and loss use netem when the kernel
has it (`Hosts.netem_available()`: the kernel of the 2-core CI box was built without
sch_netem, so there only rate is shaped); a partition is the bridge port set down (every packet
to or from the host dropped; TCP connections see pure loss, as on a cut cable).

Teardown (close(), the context manager, and an atexit hook for a crashed test): every process
started here is SIGKILLed by pid (and any process left inside one of our namespaces, found with
`ip netns pids`), then every namespace is deleted, which deletes its veth ends and the bridge.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

_RUNS = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _tc(ns: str, *args: str) -> None:
    out = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {out.stderr.strip()}")


class HostsUnavailable(RuntimeError):
    """Network namespaces (or the tools to make them) are not available here."""


class Hosts:
    """K emulated hosts; see the module docstring."""

    live: set[Hosts] = set()  # not yet closed (the atexit hook closes these)
    _netem: bool | None = None

    def __init__(self, k: int, subnet: str | None = None):
        if k < 1 or k > 200:
            raise ValueError(f"k must be in 1..200, got {k}")
        self.k = k
        tag = f"lam{os.getpid()}x{next(_RUNS)}"
        self.bridge_ns = f"{tag}b"
        self.names = [f"{tag}h{i}" for i in range(k)]
        self.net = ipaddress.ip_network(subnet or self._free_subnet())
        self.made: list[str] = []  # namespaces created, in order
        self.procs: dict[int, list[subprocess.Popen]] = {i: [] for i in range(k)}
        self.shaping: dict[int, dict] = {}

    # ---- availability ----------------------------------------------------------------------
    _why: str | None = None
    _probed = False

    @classmethod
    def unavailable(cls) -> str | None:
        """Why namespaces cannot be made here, or None when they can (tried once, then removed)."""
        if not cls._probed:
            cls._why, cls._probed = cls._probe(), True
        return cls._why

    @staticmethod
    def _probe() -> str | None:
        if os.geteuid() != 0:
            return "emulated hosts need root (ip netns add)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` (iproute2) is not installed"
        probe = f"lamprobe{os.getpid()}"
        try:
            _ip("netns", "add", probe)
        except subprocess.CalledProcessError as exc:
            return f"cannot create a network namespace: {exc.stderr.strip()}"
        try:
            _ip("-n", probe, "link", "add", "pb", "type", "bridge")
            _ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pz")
            _ip("-n", probe, "link", "set", "pa", "up")
            _tc(
                probe,
                "qdisc",
                "add",
                "dev",
                "pa",
                "root",
                "tbf",
                "rate",
                "10mbit",
                "burst",
                "64kb",
                "latency",
                "50ms",
            )
            Hosts._netem = (
                subprocess.run(
                    [
                        "tc",
                        "-n",
                        probe,
                        "qdisc",
                        "replace",
                        "dev",
                        "pa",
                        "root",
                        "netem",
                        "delay",
                        "1ms",
                    ],
                    capture_output=True,
                ).returncode
                == 0
            )
        except (subprocess.CalledProcessError, RuntimeError) as exc:
            msg = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            return f"namespaces work but bridge/veth/tbf do not: {msg}"
        finally:
            _ip("netns", "del", probe, check=False)
        return None

    @classmethod
    def netem_available(cls) -> bool:
        """Whether the kernel has sch_netem (delay, loss); tbf (rate) is required anyway."""
        if cls._netem is None:
            cls._probe()
        return bool(cls._netem)

    @staticmethod
    def _free_subnet() -> str:
        """A 10.a.b.0/24 that no address or route of the root namespace touches (none of ours
        ever appears there, but a clash would confuse whoever reads `ip addr` on the box)."""
        used = []
        for line in (
            _ip("-o", "-4", "addr").stdout.splitlines() + _ip("-4", "route").stdout.splitlines()
        ):
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or word.count(".") == 3:
                        used.append(ipaddress.ip_network(word, strict=False))
        pid = os.getpid()
        for n in range(256 * 100):
            a, b = 100 + (pid + n) // 256 % 100, (pid + n) % 256
            net = ipaddress.ip_network(f"10.{a}.{b}.0/24")
            if not any(net.overlaps(u) for u in used):
                return str(net)
        raise HostsUnavailable("no free 10.a.b.0/24 subnet")

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Hosts:
        why = self.unavailable()
        if why:
            raise HostsUnavailable(why)
        Hosts.live.add(self)
        try:
            self._netns_add(self.bridge_ns)
            b = self.bridge_ns
            _ip("-n", b, "link", "add", "br0", "type", "bridge")
            _ip("-n", b, "link", "set", "br0", "up")
            _ip("-n", b, "link", "set", "lo", "up")
            prefix = self.net.prefixlen
            for i, ns in enumerate(self.names):
                self._netns_add(ns)
                # made inside the bridge namespace, one end moved into the host: never in root
                _ip(
                    "-n",
                    b,
                    "link",
                    "add",
                    f"p{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                _ip("-n", b, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", b, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/{prefix}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _netns_add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)

    def close(self) -> None:
        """Kill every process started here (and any left in our namespaces), delete them all."""
        for i in range(self.k):
            self.kill_host(i)
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)
        self.made.clear()
        Hosts.live.discard(self)

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- addresses and processes -----------------------------------------------------------
    def addr(self, i: int) -> str:
        return str(self.net.network_address + 1 + i)

    def ns(self, i: int) -> str:
        return self.names[i]

    def popen(
        self,
        i: int,
        cmd: Sequence[str],
        log: Path | IO | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start `cmd` in host i (`ip netns exec` execs it: the pid is the command's own)."""
        out = open(log, "ab") if isinstance(log, Path) else log  # noqa: SIM115 - the child owns it
        try:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.names[i], *cmd],
                stdout=out or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            if isinstance(log, Path) and out is not None:
                out.close()
        self.procs[i].append(p)
        return p

    def run(self, i: int, cmd: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.names[i], *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pids_in(self, i: int) -> list[int]:
        """Every process whose network namespace is host i's (ours, and any they forked)."""
        if self.names[i] not in self.made:
            return []
        out = _ip("netns", "pids", self.names[i], check=False).stdout
        return [int(x) for x in out.split()]

    def kill_host(self, i: int) -> float:
        """SIGKILL every process of host i; returns the time of the kill (time.time())."""
        t = time.time()
        killed = []
        for p in self.procs[i]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                    killed.append(p.pid)
        for pid in self.pids_in(i):  # children they forked (reward workers, ...): still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        for pid in killed:  # Intel OpenMP's per-process marker, which only a clean exit removes
            for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
                f.unlink(missing_ok=True)
        for p in self.procs[i]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while self.pids_in(i) and time.monotonic() < deadline:
            time.sleep(0.05)  # reaping by init after SIGKILL; no event to wait on
        return t

    def stop_host(self, i: int, timeout: float = 15.0) -> None:
        """SIGTERM host i's processes (graceful stop), SIGKILL what is left after `timeout`."""
        for p in self.procs[i]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs[i]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill_host(i)

    # ---- links -----------------------------------------------------------------------------
    def shape(
        self,
        i: int,
        rate_bytes_s: float | None = None,
        delay_ms: float = 0.0,
        loss_pct: float = 0.0,
    ) -> None:
        """Shape host i's link, both directions: rate (tbf), delay and loss (netem). None/0 for
        all three removes the shaping."""
        self.shaping[i] = {"rate_bytes_s": rate_bytes_s, "delay_ms": delay_ms, "loss_pct": loss_pct}
        shape_link(self.names[i], self.bridge_ns, i, rate_bytes_s, delay_ms, loss_pct)

    def partition(self, i: int) -> float:
        """Cut host i off (its bridge port down: every packet either way is lost); returns when."""
        _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "down")
        return time.time()

    def heal(self, i: int) -> float:
        _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "up")
        return time.time()


def shape_link(
    host_ns: str,
    bridge_ns: str,
    i: int,
    rate_bytes_s: float | None = None,
    delay_ms: float = 0.0,
    loss_pct: float = 0.0,
) -> None:
    """Hosts.shape by names (for a process that runs inside one of the namespaces: `tc -n`
    reaches any named namespace)."""
    for ns, dev in ((host_ns, "eth0"), (bridge_ns, f"p{i}")):
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if delay_ms or loss_pct:
            if not Hosts.netem_available():
                raise HostsUnavailable("delay/loss need sch_netem, which this kernel lacks")
            args = ["netem"]
            if delay_ms:
                args += ["delay", f"{delay_ms}ms"]
            if loss_pct:
                args += ["loss", f"{loss_pct}%"]
            if rate_bytes_s:
                args += ["rate", f"{int(rate_bytes_s * 8)}bit"]
            _tc(ns, "qdisc", "add", "dev", dev, "root", *args)
        elif rate_bytes_s:
            # burst: >= one 64 KiB GSO segment and ~4 ms of the rate; queue: 100 ms of it
            burst = max(64 << 10, int(rate_bytes_s / 250))
            _tc(
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{int(rate_bytes_s * 8)}bit",
                "burst",
                str(burst),
                "latency",
                "100ms",
            )


@atexit.register
def _close_all() -> None:
    for h in list(Hosts.live):
        with contextlib.suppress(Exception):
            h.close()


# ---- a laminar cluster across the hosts ----------------------------------------------------
BASE_PORT = 15550  # every host has its own port space: the same ports on every host


def tcp_endpoints(
    hosts: Hosts, relays: int, head: int = 0, base_port: int = BASE_PORT
) -> dict[str, str]:
    """cluster.endpoints: manager/buffer/trainer/tools on host `head`, relay i on host i."""
    from laminar.config import _PORT_OFFSETS as OFF

    at = lambda i, port: f"tcp://{hosts.addr(i)}:{port}"  # noqa: E731
    eps = {s: at(head, base_port + OFF[s]) for s in ("manager", "buffer", "trainer", "tools")}
    for r in range(relays):
        for s in ("relay", "relay_pub", "relay_data"):
            eps[f"{s}-{r}"] = at(r, base_port + OFF[s] + r)
    return eps


def make_keys(keys_dir: Path, roles: str = "manager,buffer,relay,trainer,rollout") -> Path:
    """CURVE keys with an identity per role, made by the real CLI (`laminar keys`)."""
    import sys

    subprocess.run(
        [sys.executable, "-m", "laminar", "keys", str(keys_dir), "--roles", roles],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return keys_dir


def node_cmd(role: str, config: Path, index: int = 0, count: int = 1, *overrides: str) -> list[str]:
    """`laminar node --role ROLE --index I --count N --config F [k=v ...]` (launchers' argument
    order)."""
    import sys

    return [
        sys.executable,
        "-m",
        "laminar",
        "node",
        "--role",
        role,
        "--index",
        str(index),
        "--count",
        str(count),
        "--config",
        str(config),
        *overrides,
    ]

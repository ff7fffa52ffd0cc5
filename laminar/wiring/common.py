"""What several roles' settings share, made from the config: the node base's settings, socket
options and per-socket message limits, relay links, the weights channel and broadcast group,
and the plaintext-tcp warning.

    node = node_settings(cfg, "buffer", 0)              # NodeSettings: what the Node base reads
    opts = socket_options(cfg, "rollout")               # heartbeats, deadlines, CURVE keys
    n = socket_max_message_bytes(cfg, "buffer")         # a server socket's MAXMSGSIZE
    channel = weights_channel(cfg)                      # how weights move, as both ends open it
"""

from __future__ import annotations

from pathlib import Path

from laminar.config import ConfigError, LaminarConfig
from laminar.message import Limits
from laminar.node_settings import NodeSettings
from laminar.transport.security import Security
from laminar.transport.sockets import IdBound, SocketOptions
from laminar.weights.channel import ChannelSettings, RelayLinks, WeightsMode
from laminar.weights.group import GroupSettings


def node_settings(
    cfg: LaminarConfig, role: str, index: int = 0, node_id: str | None = None
) -> NodeSettings:
    """What the Node base of `role`-`index` reads (node_id: `role-index` unless given)."""
    t = cfg.transport
    return NodeSettings(
        index=index,
        node_id=node_id or f"{role}-{index}",
        socket=socket_options(cfg, role),
        manager=cfg.endpoint("manager"),
        startup_timeout_s=t.startup_timeout_s,
        stop_timeout_s=t.stop_timeout_s,
        plaintext_warning=plaintext_tcp_warning(cfg),
    )


def socket_options(cfg: LaminarConfig, role: str = "node") -> SocketOptions:
    """The transport settings of a node of `role`: heartbeats, deadlines, limits, its
    CURVE keys (none when `security.keys_dir` is unset) and, for its servers, the bound on live
    rollout ids (cluster.max_rollouts; the run's own ids reserved)."""
    t = cfg.transport
    keys = cfg.security.keys_dir
    return SocketOptions(
        heartbeat_interval_s=t.heartbeat_interval_s,
        heartbeat_liveness=t.heartbeat_liveness,
        handshake_timeout_s=t.handshake_timeout_s,
        request_timeout_s=t.request_timeout_s,
        request_retries=t.request_retries,
        reconnect_backoff_s=t.reconnect_backoff_s,
        reconnect_backoff_max_s=t.reconnect_backoff_max_s,
        sndhwm=t.sndhwm,
        rcvhwm=t.rcvhwm,
        limits=Limits(max_header_bytes=t.max_header_bytes, max_message_bytes=t.max_message_bytes),
        security=Security.for_role(keys, role, cfg.security.key_name) if keys else None,
        id_bound=IdBound(
            "rollout", cfg.cluster.live_rollouts_bound(), frozenset(cfg.cluster.rollout_ids())
        ),
    )


# Sizing the per-socket limits (issue 15): a socket accepts what it carries, not 2 GiB.
_BYTES_PER_TOKEN = 64
"""Generous bytes per trajectory token on the wire: id + logprob + mask arrays (9 B) plus the
token's share of text, info and msgpack overhead."""


def trajectory_bytes(cfg: LaminarConfig) -> int:
    """Upper bound of one trajectory on the wire: prompt plus the longest episode (multi-turn
    env limits: model and environment tokens together) at `_BYTES_PER_TOKEN`."""
    episode = cfg.rollout.sampling.max_tokens
    if cfg.env.fn is not None:
        limits = cfg.env.limits
        episode = max(episode, limits.max_total_tokens or 0, limits.max_turns * episode)
    return (cfg.data.max_prompt_tokens + episode) * _BYTES_PER_TOKEN


def socket_max_message_bytes(cfg: LaminarConfig, service: str) -> int:
    """MAXMSGSIZE of a server socket by what it carries:

    - manager: heartbeats, status, moves; ExportReply hands over up to max_running partial
      trajectories, so max(control limit, max_running x trajectory);
    - buffer: a whole group of trajectories (derived; `transport.buffer_max_message_bytes`
      overrides, `buffer_min_message_bytes` is the floor);
    - relay / relay_data: one weight chunk plus its header;
    - anything else (tools, control): `transport.control_max_message_bytes`.
    Never above `transport.max_message_bytes`."""
    t = cfg.transport
    if service == "manager":
        n = max(t.control_max_message_bytes, cfg.rollout.max_running * trajectory_bytes(cfg))
    elif service == "buffer":
        derived = max(t.buffer_min_message_bytes, cfg.rollout.group_size * trajectory_bytes(cfg))
        n = t.buffer_max_message_bytes or derived
    elif service in ("relay", "relay_data"):
        n = cfg.relay.chunk_bytes + t.max_header_bytes + (64 << 10)
    else:
        n = t.control_max_message_bytes
    return min(n, t.max_message_bytes)


def relay_links(cfg: LaminarConfig) -> RelayLinks:
    """Where the relays listen and how long their clients wait (every relay index the
    cluster runs, and at least this rollout's `rollout.relay_index`)."""
    n = max(1, cfg.cluster.roles.get("relay", 1), cfg.rollout.relay_index + 1)
    return RelayLinks(
        control=tuple(cfg.endpoint("relay", i) for i in range(n)),
        pub=tuple(cfg.endpoint("relay_pub", i) for i in range(n)),
        startup_timeout_s=cfg.transport.startup_timeout_s,
        request_timeout_s=cfg.transport.request_timeout_s,
        probe_timeout_s=cfg.relay.probe_timeout_s,
        chunk_bytes=cfg.relay.chunk_bytes,
        window=cfg.relay.window,
    )


def weights_group(cfg: LaminarConfig) -> GroupSettings:
    """The weights store and broadcast group of a run (rollout.weights nccl / cuda_ipc): the
    rollouts rollout-0 .. rollout-{cluster.roles.rollout - 1} may join."""
    g = cfg.rollout.weights_group
    host, port = cfg.weights_store()
    backend = g.backend
    if backend == "auto":
        backend = "nccl" if cfg.model.device.startswith("cuda") else "gloo"
    rollouts = cfg.cluster.roles.get("rollout", 1)
    return GroupSettings(
        host=host,
        port=port,
        backend=backend,
        members=tuple(f"rollout-{i}" for i in range(max(1, rollouts))),
        bound_s=g.bound_s,
        beat_s=g.beat_s,
        connect_timeout_s=cfg.transport.startup_timeout_s,
    )


def weights_mode(cfg: LaminarConfig) -> WeightsMode:
    """How weights move in this run; both ends derive it from the same config, so they agree:
    `rollout.weights` when set; `auto` is relay when the config runs relays, else announce
    when either end is a sim engine (one end has no tensors), else dir."""
    if cfg.rollout.weights != "auto":
        return cfg.rollout.weights
    if cfg.cluster.roles.get("relay", 0) > 0:
        return "relay"
    if cfg.trainer.engine == "sim" or cfg.rollout.engine == "sim":
        return "announce"
    return "dir"


def weights_channel(cfg: LaminarConfig) -> ChannelSettings:
    """The weights channel of this run, as both ends open it."""
    mode = weights_mode(cfg)
    gpu = mode in ("nccl", "cuda_ipc")
    relays = mode == "relay" or (gpu and cfg.cluster.roles.get("relay", 0) > 0)
    return ChannelSettings(
        mode=mode,
        dir=Path(cfg.resolved_run_dir()) / "weights",
        relay=relay_links(cfg) if relays else None,
        relay_index=cfg.rollout.relay_index,
        group=weights_group(cfg) if gpu else None,
        device=cfg.model.device,
        lease_ttl_s=cfg.rollout.weights_group.lease_ttl_s,
    )


def plaintext_tcp_warning(cfg: LaminarConfig) -> str | None:
    """The loud startup warning when tcp endpoints run without CURVE, else None."""
    if cfg.security.keys_dir:
        return None
    tcp = [e for e in _endpoints(cfg) if e.startswith("tcp://")]
    if not tcp:
        return None
    return (
        f"tcp endpoints {tcp[:3]} run WITHOUT CURVE: anyone who reaches them can read the "
        "traffic and claim any role or node id (a fake trainer can take batches). Make keys with "
        "`laminar keys DIR --roles ...` and set security.keys_dir"
    )


def _endpoints(cfg: LaminarConfig) -> list[str]:
    out = []
    for role in ("manager", "buffer", "relay", "tools"):
        try:
            out.append(cfg.endpoint(role))
        except ConfigError:
            continue
    return out

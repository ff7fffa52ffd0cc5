"""The wiring layer: the one place where the config tree becomes each part's settings.

    cfg = load_config(...)                       # laminar/config.py: the whole LaminarConfig
    node = build_node(cfg, "buffer", 0)          # laminar/wiring/nodes.py
      └─ buffer_node_settings(cfg, 0)            # laminar/wiring/buffer.py: BufferNodeSettings
           └─ node_settings(cfg, "buffer", 0)    # laminar/wiring/common.py: NodeSettings
    BufferNode(settings)                         # laminar/buffer/node.py: runs, never sees cfg

A node process receives only its own settings (its config sections and the values derived
from the whole tree: endpoints, socket limits, the weights channel, per-rollout shares).
`laminar/wiring/common.py` holds what several roles share (socket options, message-size
limits, relay links, the weights channel and group, the plaintext-tcp warning); one module per
role (buffer, manager, relay, rollout, trainer, tools) builds that role's settings; offline
tools (`laminar fates`, `laminar plan`, `laminar status`) import these builders, not nodes.

Only the loader (laminar/config.py), this package, the CLI and launch entry points
(laminar/cli*, laminar/launch/*, laminar/cluster.py), the offline tools and the demos see the
whole `LaminarConfig`.
"""

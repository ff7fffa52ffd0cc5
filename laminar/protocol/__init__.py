"""The message catalogue: every role message type, in one registry (laminar.message.REGISTRY).

Type-id ranges, one module each, so areas never collide:
    0x01-0x1F session (handshake, heartbeat, errors)             laminar/transport/session.py
              and the node status (0x03)                         core.py
    0x20-0x2F shared data (prompts, trajectories)                data.py
    0x30-0x4F buffer (prompt pool, partial pool, batches)        buffer.py
    0x50-0x6F relay and weight transport                         relay.py
    0x70-0x8F manager (status, repack, recovery, chain)          manager.py
    0x90-0x9F rollout                                            rollout.py
    0xA0-0xAF trainer                                            trainer.py
    0xB0-0xBF tools (sandboxed tool calls)                       tools.py
    0xC0-0xCF buffer journal records (never on a socket)         laminar/buffer/records.py
    0xF0-0xFF tests only
"""

from laminar.protocol import buffer, core, data, manager, relay, rollout, tools, trainer  # noqa: F401

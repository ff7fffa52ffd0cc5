"""Relay and weight-transport messages (0x50-0x6F).

trainer ──StageRequest──► master relay ──StageReply(shm segment)──► trainer   (memcpy into shm)
                          (a relay that is not master answers NotMaster(master=<i>): push there)
trainer ──PushChunk*──► master relay                                      (remote trainer: no shm)
trainer ──CommitRequest──► master relay ──CommitReply──► trainer          (trainer resumes here)
relay k ──VersionOffer (one-way, data socket)──► relay k+1                (a version to fetch)
relay k+1 ──FetchChunk──► relay k ──WeightChunk(data frame)──► relay k+1  (pipelined, windowed)
relay ──WeightsReady (PUB)──► local rollouts
rollout ──PullRequest──► relay ──PullReply(segment + layout)──► rollout ──ReleaseRequest──► relay
manager ──ChainUpdate──► relay;  relay, trainer, manager, cli ──ChainInfoRequest──► relay
trainer (GPU) ──CudaIpcHandle──► rollouts on the same host           (laminar/weights/cuda_ipc.py)

Layouts and checksums: laminar/weights/layout.py; the channel ends: laminar/weights/.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from msgspec import field

from laminar.message import Arr, Message, message

__all__ = [
    "WeightLayout",
    "RelayStatus",
    "WeightsReady",
    "StageRequest",
    "StageReply",
    "PushChunk",
    "CommitRequest",
    "CommitReply",
    "PullRequest",
    "PullReply",
    "ReleaseRequest",
    "LatestRequest",
    "LatestReply",
    "ChainUpdate",
    "ChainInfoRequest",
    "ChainInfo",
    "VersionOffer",
    "OfferRequest",
    "FetchChunk",
    "WeightChunk",
    "RelayReset",
    "CudaIpcHandle",
    "NcclAnnounce",
    "NotMaster",
]

ChunkBytes = Annotated[np.ndarray, Arr(("uint8",), ndim=1)]


@message(0x50, senders=("trainer", "relay"))
class WeightLayout(Message):  # travels with every version: how to view the flat buffer as tensors
    names: list[str]
    dtypes: list[str]
    """torch dtype names without the prefix: float32, bfloat16, int64 ..."""
    shapes: list[list[int]]
    offsets: list[int]
    """Byte offset of each tensor in the flat buffer (aligned, non-overlapping)."""
    total_bytes: int


@message(0x51, senders=("relay",))
class WeightsReady(Message):  # relay -> local rollouts (PUB topic "weights"): version v is servable
    version: int
    checksum: str
    layout: WeightLayout
    relay: str = ""
    chunk_bytes: int = 0


@message(0x52, senders=("trainer",))
class StageRequest(Message):  # trainer -> master relay: reserve a staging buffer for a version
    version: int
    layout: WeightLayout
    takeover: bool = False
    """The trainer found the named master dead: the receiving relay becomes master."""


@message(0x53, senders=("relay",))
class StageReply(Message):  # master relay -> trainer: where to write (or stream) the version
    token: int
    segment: str
    """Path of the shared-memory file to write into (same host), "" when streaming is required."""
    size: int
    host: str = ""
    inode: int = 0
    chunk_bytes: int = 0


@message(0x54, senders=("trainer",))
class PushChunk(Message):  # trainer -> master relay: one chunk of a staged version (remote trainer)
    version: int
    token: int
    offset: int
    data: ChunkBytes


@message(0x55, senders=("trainer",))
class CommitRequest(Message):  # trainer -> master relay: the staged bytes are complete
    version: int
    token: int


@message(0x56, senders=("relay",))
class CommitReply(Message):  # master relay -> trainer: handed off; the trainer may resume
    version: int
    master: int


@message(0x57, senders=("rollout",))
class PullRequest(Message):  # rollout -> relay: pin a version (-1 = newest) and tell me where it is
    version: int = -1


@message(0x58, senders=("relay",))
class PullReply(Message):  # relay -> rollout
    version: int
    checksum: str
    segment: str
    size: int
    layout: WeightLayout
    chunk_bytes: int


@message(0x59, senders=("rollout",))
class ReleaseRequest(Message):  # rollout -> relay: unpin a version
    version: int


@message(0x5A, senders=("rollout",))
class LatestRequest(
    Message
):  # rollout -> relay: newest version (after my PUB subscription is live)
    subscriber: str = ""
    """When set, the relay first waits until this subscriber is attached to its PUB socket."""


@message(0x5B, senders=("relay",))
class LatestReply(Message):  # relay -> rollout
    version: int = -1
    checksum: str = ""


@message(0x5C, senders=("manager",))
class ChainUpdate(Message):  # manager -> relay: the chain order (head = master)
    epoch: int
    order: list[int]
    """Relay indices, master first."""
    data_endpoints: dict[str, str] = field(default_factory=dict)
    """Optional relay index (as str) -> data endpoint, when not derivable from the config."""


@message(0x5D, senders=("relay", "trainer", "manager", "cli"))
class ChainInfoRequest(Message):  # any -> relay
    pass


@message(0x5E, senders=("relay",))
class ChainInfo(Message):  # relay -> any: this relay's view of the chain and its versions
    index: int
    epoch: int
    order: list[int]
    master: int
    """The head of the chain as this relay sees it (-1: this relay is not in the order)."""
    upstream: int
    """-1 when this relay is the head (or idle)."""
    version: int
    """Newest complete version (-1: none)."""
    checksum: str = ""
    incoming_version: int = -1
    incoming_have: int = 0
    incoming_chunks: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    state: str = ""
    """What the chain follower is doing (diagnostics)."""


class RelayStatus(Message):  # relay -> manager, inside NodeStatus.relay on every beat
    master: int
    """The head of the chain as this relay sees it."""
    upstream: int
    """The relay it fetches from (-1: none, it is the head)."""
    epoch: int
    incoming: int = -1
    """The newest version it is receiving (-1: none): the manager's straggler watch samples
    the chain only while some relay has one above its `NodeStatus.version`."""
    pinned: int = 0
    """Versions pinned by its rollouts (pins, counted)."""


@message(0x5F, senders=("relay",))
class VersionOffer(Message):  # relay k -> relay k+1 (data socket): a version k has or is receiving
    version: int
    layout: WeightLayout | None = None
    chunk_bytes: int = 0
    """-1 version / None layout: nothing to offer yet."""


@message(0x60, senders=("relay",))
class OfferRequest(Message):  # relay k+1 -> relay k (data socket): what is your newest version?
    pass


@message(0x61, senders=("relay",))
class FetchChunk(
    Message
):  # relay k+1 -> relay k: chunk `index` of `version` (waits until k has it)
    version: int
    index: int
    base_version: int = -1
    """Delta mode: the complete version the requester holds and can rebuild on (-1: send it
    whole)."""


@message(0x62, senders=("relay",))
class WeightChunk(Message):  # relay k -> relay k+1: one verified chunk, data as a zero-copy frame
    version: int
    index: int
    offset: int
    digest: int
    """crc32 of the full chunk (after a delta is applied) in the low 32 bits."""
    data: ChunkBytes
    base_version: int = -1
    """Delta mode: >= 0 when data is a sparse delta against that version
    (laminar/weights/delta.py)."""
    version_checksum: str = ""
    """The whole version's checksum once the sender knows it (always on the last chunk)."""


@message(0x63, senders=("trainer",))
class RelayReset(Message):  # trainer -> relay (benches): drop unpinned versions and spare slots
    keep_spare: bool = True


@message(0x64, senders=("trainer",))
class CudaIpcHandle(Message):  # GPU trainer -> rollouts on its host: a version as a CUDA IPC handle
    version: int
    checksum: str
    layout: WeightLayout
    device: int
    """The trainer's index of its GPU (meaningless in another process: use device_uuid)."""
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes = b""
    event_sync_required: bool = False
    device_uuid: str = ""
    """The GPU's UUID: a reader maps it onto its own index (CUDA_VISIBLE_DEVICES renumbers)."""


@message(0x65, senders=("trainer",))
class NcclAnnounce(Message):  # trainer -> NCCL group members: the next broadcast is this version
    version: int
    checksum: str
    layout: WeightLayout


@message(0x66, senders=("relay",))
class NotMaster(Message):  # relay -> trainer: not master, StageRequest goes to `master`
    master: int
    """Index of the relay this one names as the chain's master."""

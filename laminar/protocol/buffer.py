"""Buffer messages (0x30-0x4F): prompt pool, experience buffer, batches, partial pool queries.

    rollout ──PromptRequest──► buffer ──PromptReply(items)──► rollout    (credits: ask for room)
    rollout ──PartialChunk (one-way)──► buffer                           (partial-response pool)
    rollout ──Trajectory (request)──► buffer ──TrajectoryAck──► rollout  (resent until acked, dedup)
    rollout ──Deliveries (request)──► buffer ──DeliveryAcks──► rollout   (several of them at once)
    trainer ──BatchRequest──► buffer ──BatchReply(trajectories)──► trainer     (long-poll, groups)
    trainer ──BatchCommit──► buffer ──CommitAck                          (exactly-once consumption)
    manager ──PartialsRequest──► buffer ──PartialsReply──► manager       (recovering a dead rollout)
    manager ──SamplesPlaced──► buffer ──Ack                              (moved: who sends them now)
    manager ──HeldRequest──► buffer ──HeldReply──► manager    (which samples each rollout holds)
    trainer, manager, cli ──BufferStatsRequest──► buffer ──BufferStats  (figures: tests, benches)
    rollout, trainer ──ImageFetch──► buffer ──ImageBlobs               (a prompt's images by digest)
    rollout ──ImagePut──► buffer ──ImagePutReply             (an image a later turn added, once)

A reply that acknowledges a change (prompts served, a trajectory, a batch, a commit) is sent
only once the buffer's journal record of it is durable (buffer.fsync).
"""

from __future__ import annotations

from typing import Literal

from msgspec import field

from laminar.message import Message, message
from laminar.protocol.data import PartialTrajectory, PromptItem, Trajectory

__all__ = [
    "AuditSummary",
    "PromptRequest",
    "PromptReply",
    "BatchRequest",
    "BatchReply",
    "BatchCommit",
    "PartialsRequest",
    "PartialsReply",
    "TrajectoryAbandoned",
    "BufferStats",
    "BufferStatsRequest",
    "BatchStaleness",
    "StalenessFigures",
    "PromptPoolFigures",
    "JournalFigures",
    "TrajectoryAck",
    "Deliveries",
    "DELIVERIES_MAX_ITEMS",
    "DeliveryAcks",
    "CommitAck",
    "Refusal",
    "SamplesPlaced",
    "HeldRequest",
    "HeldReply",
    "ImageFetch",
    "ImageBlobs",
    "ImagePut",
    "ImagePutReply",
]

Refusal = Literal[
    "not_served",
    "not_owner",
    "prompt_mismatch",
    "reward_range",
    "token_range",
    "too_long",
    "bad_routes",
]
"""Why a rollout's sample is refused: its group was never served to anyone; the sample is
another rollout's (served or moved to it); its prompt (uid, and token ids outside agent runs) is
not the one its group was served with; its reward is not finite or outside
reward.min_value..max_value; a token id lies outside the vocabulary; it is longer than any
response can be (agent runs: or its prompt longer than data.max_prompt_tokens); its MoE routes
do not fit the policy (shape tokens x moe_layers x k, expert ids below the expert count)."""


@message(0x30, senders=("rollout",), id_fields=("rollout_id",))
class PromptRequest(Message):  # rollout -> buffer
    rollout_id: str
    max_groups: int
    """Credits: how many more groups the rollout has room for."""
    version: int
    """The rollout's current weight version (admission control / modes)."""
    request_id: str = ""
    """Optional: a retry with the same (rollout_id, request_id) gets the same groups back, not new
    ones."""


@message(0x31, senders=("buffer",))
class PromptReply(Message):  # buffer -> rollout
    items: list[PromptItem] = field(default_factory=list)
    retry_after_s: float = 0.0
    """When items is empty: ask again after this long."""
    reason: str = ""
    """Why nothing was served: empty | full | rollout_full (this rollout holds its share of open
    groups) | staleness | need_version | epochs_done | global_update."""
    min_version: int = -1
    """The version the rollout must load before new prompts are served (modes with global
    updates)."""


@message(0x32, senders=("trainer",), id_fields=("trainer_id",))
class BatchRequest(Message):  # trainer -> buffer
    trainer_id: str
    groups: int
    trainer_version: int
    wait_s: float = 1.0
    """Long-poll: wait up to this long for enough whole groups."""
    restart: bool = False
    """First request after a trainer (re)start: batches served but never committed go back to the
    queue front."""


class BatchStaleness(Message):  # inside BatchReply: the served batch's staleness
    min: int
    max: int
    mean: float
    hist: dict[str, int] = field(default_factory=dict)
    """Staleness (as text) -> trajectories."""


class AuditSummary(Message):  # inside BatchReply: the per-length audit's live figures
    """Over the trajectories with a fate (committed or dropped), laminar/buffer/audit.py."""

    long_min_tokens: int
    """Shortest response of the longest length bucket (buckets: buffer.audit_buckets)."""
    short_max_tokens: int
    """Longest response of the shortest bucket."""
    long_kept: float | None = None
    """Of the longest bucket's trajectories with a fate: the share trained on (None: none yet)."""
    short_kept: float | None = None
    long_vs_short: float | None = None
    """long_kept / short_kept: 1 = no length bias; below buffer.audit_warn_ratio warns."""
    long_token_share_generated: float | None = None
    """The longest bucket's share of the response tokens generated (of trajectories with a
    fate)."""
    long_token_share_trained: float | None = None
    """Its share of the trained (consumed) response tokens."""
    long_decided: int = 0
    short_decided: int = 0
    dropped: int = 0
    """Finished trajectories dropped so far (every bucket, every reason)."""


@message(0x33, senders=("buffer",))
class BatchReply(Message):  # buffer -> trainer
    batch_id: str = ""
    trajectories: list[Trajectory] = field(default_factory=list)
    """Whole groups, FIFO; empty when not enough groups arrived within wait_s."""
    version: int = -1
    """The batch version (trajectories are judged stale against it); when empty, the version
    the next batch would have."""
    group_ids: list[str] = field(default_factory=list)
    requeued_groups: int = 0
    """Groups served again after a trainer restart put their batch back."""
    partial_groups: int = 0
    """Groups released with fewer members than asked for (lost members)."""
    staleness: BatchStaleness | None = None
    """Of the served trajectories: version - trajectory version (None when empty)."""
    wait: str = ""
    """When empty: why no batch was served (the plan's reason, e.g. not_enough)."""
    exhausted: bool = False
    """When empty: the data's epochs are done and nothing is left in the buffer (trainer stops)."""
    ready: int = 0
    """When empty: groups ready to train."""
    open: int = 0
    """When empty: groups still generating."""
    audit: AuditSummary | None = None
    """The buffer's per-length audit as last made (every buffer.audit_interval_s); None before
    its first."""


@message(0x34, senders=("trainer",))
class BatchCommit(Message):  # trainer -> buffer: the step that consumed batch_id committed
    batch_id: str
    step: int
    version: int
    """The trainer version after the step."""


@message(0x35, senders=("manager",))
class PartialsRequest(Message):  # manager -> buffer
    rollout_id: str = ""
    """All in-flight trajectories last reported by this rollout (empty: use uids)."""
    uids: list[str] = field(default_factory=list)


@message(0x36, senders=("buffer",))
class PartialsReply(Message):  # buffer -> manager
    partials: list[PartialTrajectory] = field(default_factory=list)


@message(0x37, senders=("rollout",))
class TrajectoryAbandoned(Message):  # rollout -> buffer: this sample is lost for good
    uid: str
    group_id: str
    reason: str = ""


class StalenessFigures(Message):  # inside BufferStats: a staleness histogram, summarised
    count: int = 0
    mean: float | None = None
    p50: int = 0
    p99: int = 0
    max: int = 0
    hist: dict[str, int] = field(default_factory=dict)
    """Staleness (as text) -> trajectories."""


class PromptPoolFigures(Message):  # inside BufferStats: where the prompt pool stands
    rows: int
    epoch: int
    pos: int
    serial: int
    bad_rows: int
    exhausted: bool


class JournalFigures(Message):  # inside BufferStats: the buffer journal's counters
    path: str
    size: int
    records: int = 0
    bytes: int = 0
    fsyncs: int = 0
    torn_bytes: int = 0
    torn_offset: int = -1
    replayed: int = 0
    bad_records: int = 0
    upgraded_from_schema: int = 0


@message(0x38, senders=("buffer",))
class BufferStats(Message):  # buffer -> anyone asking (status, tests, benches): reply
    mode: str
    bound: int | None
    """The staleness bound of the mode (None: unbounded)."""
    capacity: int
    trainer_version: int
    next_version: int
    held: int
    """Trajectories of live groups."""
    pending: int
    """Samples still generating in open groups."""
    groups_open: int
    groups_ready: int
    groups_outstanding: int
    outstanding_batches: int
    closed_groups: int
    counts: dict[str, int] = field(default_factory=dict)
    """The state's event counts by name (trajectories, unusable, groups_dropped,
    dropped_<reason>, batches_served, groups_committed ...), journaled with it."""
    counters: dict[str, int] = field(default_factory=dict)
    """The node's metric counters by name (prompts_refused_full, batches_served ...)."""
    partials: dict[str, int] = field(default_factory=dict)
    """The partial-response pool: in_flight and its counts by name."""
    rollout_versions: dict[str, int] = field(default_factory=dict)
    """Rollout id -> the version its last PromptRequest said it holds."""
    warnings: dict[str, str] = field(default_factory=dict)
    """Active warnings by kind (laminar/buffer/health.py)."""
    staleness_finish: StalenessFigures = field(default_factory=StalenessFigures)
    """Staleness of trajectories when they finished."""
    staleness_consumed: StalenessFigures = field(default_factory=StalenessFigures)
    """Staleness of trajectories when a committed batch consumed them."""
    prompts: PromptPoolFigures | None = None
    """None without a prompt pool (prompts come from elsewhere)."""
    journal: JournalFigures | None = None
    """None without a journal (buffer.journal off)."""
    refused: dict[str, dict[str, int]] = field(default_factory=dict)
    """Peer node id -> refusal reason (TrajectoryAck.refused, or a partial entry's) -> count:
    trajectories and partial entries that were refused and never stored."""
    audit: AuditSummary | None = None
    """The per-length audit as last made (None before the first served batch)."""
    unusable_causes: dict[str, int] = field(default_factory=dict)
    """Trajectories stored without a usable reward since the buffer started, by cause (the
    reward's or agent's error, an engine error ...; laminar/buffer/health.py), the most
    frequent first: `laminar run` names them when nothing can train."""


@message(0x3C, senders=("manager",))
class SamplesPlaced(Message):  # manager -> buffer: these samples now run on `dest` (reply: Ack)
    dest: str
    """The rollout the manager is about to import them on (a repack move or a recovery)."""
    uids: list[str] = field(default_factory=list)


@message(0x39, senders=("trainer", "manager", "cli"))
class BufferStatsRequest(Message):  # trainer, manager, cli -> buffer: answered with BufferStats
    pass


@message(0x3A, senders=("buffer",))
class TrajectoryAck(Message):  # buffer -> rollout: a Trajectory / TrajectoryAbandoned is journaled
    duplicate: bool = False
    """The sample was stored before (a resent trajectory): stored once, acked again."""
    ignored: str = ""
    """Why it changed nothing though valid (a member of a closed group, already finished)."""
    refused: Refusal | Literal[""] = ""
    """Why the buffer will never take it (not served to this sender, reward or token ids out of
    range): not stored, not trained, counted per peer; the sender must not send it again."""
    rejected: str = ""
    """In DeliveryAcks only: why this item is malformed (what ErrorReply "protocol" says of one sent
    alone): never stored, and never accepted if sent again."""


DELIVERIES_MAX_ITEMS = 256
"""Items one Deliveries may carry (the buffer answers more with ErrorReply "protocol")."""


@message(0x43, senders=("rollout",), nested=("trajectories", "abandoned"))
class Deliveries(Message):  # rollout -> buffer: finished and abandoned samples of one window
    """What Trajectory and TrajectoryAbandoned say one by one, for several samples in one request
    (the buffer pays per message): each item is checked, journaled and answered as it would be
    alone, and held to its own type's senders and id fields (laminar/message.py `nested`)."""

    trajectories: list[Trajectory] = field(default_factory=list)
    abandoned: list[TrajectoryAbandoned] = field(default_factory=list)


@message(0x44, senders=("buffer",))
class DeliveryAcks(Message):  # buffer -> rollout: answer to Deliveries, once durable
    acks: list[TrajectoryAck] = field(default_factory=list)
    """One per item: the trajectories' in order, then the abandoned ones'."""


@message(0x3B, senders=("buffer",))
class CommitAck(Message):  # buffer -> trainer: answer to BatchCommit, once durable
    ok: bool = True
    """False: a trainer restart put the batch back (it is served again); `reason` says so."""
    duplicate: bool = False
    """The batch was committed before: nothing changed."""
    reason: str = ""
    version: int = -1
    """The buffer's trainer version after the commit (-1 when not ok or a duplicate)."""


@message(0x3D, senders=("rollout", "trainer"))
class ImageFetch(Message):  # rollout, trainer -> buffer: the bytes of these images (ImageBlobs)
    digests: list[str]
    """Content digests ("sha256:...") from PromptItem / Trajectory / PartialTrajectory."""


@message(0x3E, senders=("buffer",))
class ImageBlobs(Message):  # buffer -> rollout, trainer: answer to ImageFetch
    digests: list[str]
    """The digests found, parallel to `data`."""
    data: list[bytes]
    """The encoded images; the receiver checks each against its digest before use."""
    missing: list[str] = field(default_factory=list)
    """Digests this buffer does not hold (not one of its prompts' images)."""


@message(0x3F, senders=("rollout",))
class ImagePut(Message):  # rollout -> buffer: images a later turn added (ImagePutReply)
    """An environment's or an agent's image in a later turn (a screenshot after a tool call),
    sent once to the owner, so trajectories carry only its digest and whoever needs the pixels
    (a repack destination, the trainer) fetches them (ImageFetch), as for a prompt's images."""

    digests: list[str]
    data: list[bytes]
    """The encoded images, parallel to `digests`; the buffer checks each before keeping it."""


@message(0x40, senders=("buffer",))
class ImagePutReply(Message):  # buffer -> rollout: answer to ImagePut, once the images are durable
    stored: list[str]
    """Digests the buffer now holds (kept before, or written now)."""
    refused: list[str] = field(default_factory=list)
    """Digests refused (bytes that do not match, over data.max_image_bytes, not an image)."""
    reason: str = ""
    """Why the first refused one was refused."""


@message(0x41, senders=("manager",))
class HeldRequest(Message):  # manager -> buffer: the in-flight samples these rollouts hold
    """The reconciliation's question (laminar/manager/reconcile.py): which samples the buffer
    holds tokens of on each of these rollouts, to be matched against what the rollouts say they
    run. The answer is made once per `round` and served in pages of at most `max_uids` uids (a
    page is a msgpack header, which transport.max_header_bytes bounds): the same question asked
    again with the same `round` gets the next page."""

    rollout_ids: list[str] = field(default_factory=list)
    round: int = 0
    """The asker's round id (unique per round, across manager restarts)."""
    max_uids: int = 4096


@message(0x42, senders=("buffer",))
class HeldReply(Message):  # buffer -> manager: answer to HeldRequest (one page)
    held: dict[str, list[str]] = field(default_factory=dict)
    """Rollout id -> uids of the samples with a partial record that it holds: the rollout the
    manager last placed the sample on, else the one that last reported it (the owner a
    PartialsRequest(rollout_id) recovers by). A rollout holding none is left out; one holding
    more than a page has the first max_uids (in uid order)."""
    more: bool = False
    """Further pages of this round follow: ask again with the same round."""

"""The control-plane bench's driver (bench/cp_cluster.py runs it beside the nodes under test): the
synthetic rollouts and trainer, offering the 1024-GPU rates the simulator's results give
(bench/cp_workload.py workload_rates; the derivation is in bench/control_plane.py's docstring).
Each synthetic rollout asks for prompts, streams partial batches, pushes its status and sends its
finished trajectories through the rollout's own Outbox, as a real one does."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import structlog  # noqa: E402
from cp_workload import FLUSH_S  # noqa: E402

LOSS_MASK = os.environ.get("CP_LOSS_MASK", "0") == "1"
"""Entries and trajectories carry a loss mask (multi-turn: ~15% environment tokens)."""
TRAINER_BATCH_GROUPS = 128
"""Groups per synthetic trainer batch (512 trajectories, ~1 s of the 1x rate): a 1024-GPU trainer
step takes 512 groups of 16, and a trainer of 16-group batches would need 16 round trips a second
at 2x, fall behind and let the buffer's held state grow without end."""


class Driver:
    def __init__(self, cfg: Any, rates: dict[str, float], ctx: Any, shards: list[str]):
        self.cfg, self.rates, self.ctx = cfg, rates, ctx
        self.shards = shards
        """Buffer endpoints; synthetic rollout i talks to shard i % len(shards) (keyed by
        rollout)."""
        self.rollouts = int(rates["rollouts"])
        self.entry_tokens = max(1, round(rates["entry_tokens"]))
        """Tokens per partial entry (workload_rates): every entry moves its sample on by these."""
        self.chunks_per_traj = max(1, round(rates["chunks_s"] / rates["trajectories_s"]))
        self.entries_per_batch = max(1, round(rates["chunks_s"] * FLUSH_S / self.rollouts))
        self.resp_len = self.chunks_per_traj * self.entry_tokens
        self.ids = np.arange(self.resp_len, dtype=np.int32) % 1000
        self.lps = np.full(self.resp_len, -0.5, np.float32)
        self.flat_ids = np.arange(self.entries_per_batch * self.resp_len, dtype=np.int32) % 1000
        self.flat_lps = np.full(len(self.flat_ids), -0.5, np.float32)
        # multi-turn (CP_LOSS_MASK=1): an environment token in every 7 (the trajectory's mask is
        # the start of the batches' one)
        self.flat_mask = (
            (np.arange(len(self.flat_ids)) % 7 != 6).astype(np.uint8) if LOSS_MASK else None
        )
        self.mask = None if self.flat_mask is None else self.flat_mask[: self.resp_len]
        self.queues: list[asyncio.Queue[tuple[Any, int]]] = [
            asyncio.Queue() for _ in range(self.rollouts)
        ]
        """Served samples per synthetic rollout: a group's samples go back from the rollout it
        was served to (the buffer takes them from no other), so to the shard that served it."""
        self.low = [asyncio.Event() for _ in range(self.rollouts)]
        """Set when synthetic rollout i's queue is down to half: its feeder asks for prompts."""
        for ev in self.low:
            ev.set()
        self.sent = {
            "batches": 0,
            "chunks": 0,
            "trajectories": 0,
            "acked": 0,
            "pushes": 0,
            "ack_failed": 0,
            "request_failed": 0,
            "trained": 0,
        }
        self.ack_lat: list[float] = []
        """Seconds from a delivery request to its reply (the buffer's answer, not the window a
        trajectory waited in its outbox)."""
        self.gen_s = self.resp_len / rates["seq_tok_s"] if rates.get("seq_tok_s") else 0.0
        """A synthetic trajectory's generation time at the workload's decode speed (its
        timings["gen_s"]: what the outbox's window is a share of)."""
        self.outboxes: list[Any] = []
        """Per synthetic rollout: the real rollout's Outbox (laminar/rollout/outbox.py) with its
        settings: it sends finished trajectories as a real rollout does, one Deliveries per
        window (rollout.deliver_window_frac), each resent until acked."""
        self.bg: set[asyncio.Task[Any]] = set()
        self.active: list[list[list[Any]]] = [[] for _ in range(self.rollouts)]
        """Per synthetic rollout: its in-flight samples [item, sample, next chunk]; kept across
        steps."""
        self.next_rollout = 0
        self.rng = random.Random(0)
        """Which rollout finishes the next trajectory of the trajectories-alone phase."""
        self.started = [False] * self.rollouts
        """Per synthetic rollout: whether it has sent a batch (its first one's samples start
        part-way)."""
        self._status: dict[int, Any] = {}
        self._part_way_n = [0] * self.rollouts
        """Per synthetic rollout: how many of its samples started part-way (_part_way)."""

    def _part_way(self, ci: int) -> int:
        """The chunk a part-way sample of synthetic rollout ci starts at: the k-th such sample at
        k * golden ratio (mod 1) of the way, shifted per rollout, so any run of them is spread
        evenly over the trajectory. Random starts made a step's finishes a sample of random
        phases: +-7% of the offered trajectories (one standard deviation) in a 15 s step at
        0.05x, which failed steps on delivery that the nodes had kept up with."""
        k = self._part_way_n[ci]
        self._part_way_n[ci] = k + 1
        phase = (k * 0.6180339887498949 + ci * 0.41421356237309503) % 1.0
        return int(phase * self.chunks_per_traj)

    def status(self, i: int) -> Any:
        """Rollout i's status (128 sequences): built once, stamped per push (the driver's own cost
        is not what is measured; the manager decodes the full status every time)."""
        from laminar.protocol.core import NodeStatus
        from laminar.protocol.rollout import RolloutStatus

        st = self._status.get(i)
        if st is None:
            toks = {f"syn{i}-{k}": 1000 + k for k in range(128)}
            rs = RolloutStatus(
                traj_tokens=toks,
                kv_capacity_tokens=1 << 20,
                measured_at=time.time(),
                target_version=0,
                groups=32,
                credits_free=0,
                max_running=128,  # an engine up: the manager lists it to the buffer as serving
            )
            st = self._status[i] = NodeStatus(
                node_id=f"rollout-{i}",
                role="rollout",
                version=0,
                kv_use=0.5,
                running=128,
                rollout=rs,
            )
        assert st.rollout is not None
        st.rollout.measured_at = time.time()
        return st

    async def connect(self) -> None:
        from laminar.transport.client import RpcClient
        from laminar.wiring.common import socket_options

        opts = socket_options(self.cfg)
        k = len(self.shards)
        self.buf = [
            RpcClient(self.ctx, self.shards[i % k], f"rollout-{i}", "rollout", opts)
            for i in range(self.rollouts)
        ]
        self.mgr = [
            RpcClient(
                self.ctx,
                self.cfg.endpoint("manager"),
                f"rollout-{i}",
                "rollout",
                opts,
                status=functools.partial(self.status, i),
            )
            for i in range(self.rollouts)
        ]
        self.trainers = [
            RpcClient(self.ctx, ep, "trainer-0", "trainer", opts) for ep in self.shards
        ]
        for c in [*self.buf, *self.mgr, *self.trainers]:
            await c.connect(timeout=30)
        from laminar.rollout.outbox import Outbox

        ro, t = self.cfg.rollout, self.cfg.transport
        self.outboxes = [
            Outbox(
                _Counted(self, cli),  # type: ignore[arg-type]
                structlog.get_logger("cp-driver"),
                ro.outbox_concurrency,
                t.request_timeout_s,
                window_frac=ro.deliver_window_frac,
                window_max_s=ro.partial_flush_s,
            )
            for cli in self.buf
        ]
        for ob in self.outboxes:
            self.spawn(ob.run(), "outbox")

    def spawn(self, coro: Any, name: str | None = None) -> None:
        t = asyncio.create_task(coro, name=name)
        self.bg.add(t)
        t.add_done_callback(self.bg.discard)

    async def supply(self, shard: int) -> None:
        """Keeps served samples queued: the synthetic rollouts of `shard` ask for prompts like
        real ones, each on its own (a feeder per rollout)."""
        await asyncio.gather(
            *(self.feed(ci) for ci in range(shard, self.rollouts, len(self.shards)))
        )

    async def feed(self, ci: int) -> None:
        """Synthetic rollout ci's prompt feeder. A real rollout asks for what its free credits
        hold (laminar/rollout/feeder.py), so it holds about its running set: here one batch's
        worth of samples in flight (`active`) and up to as many queued, asked for once the queue
        is down to half. (Asking for 64 groups whenever a queue held under 64 samples leased
        ~16x the groups a rollout runs: ~64k open samples the buffer kept and leased for
        nothing.)"""
        from laminar.protocol.buffer import PromptReply, PromptRequest

        most, n = self.entries_per_batch, self.cfg.rollout.group_size
        queue, cli, low = self.queues[ci], self.buf[ci], self.low[ci]
        while True:
            await low.wait()
            low.clear()
            want = max(1, -(-(most - queue.qsize()) // n))
            try:
                rep = await cli.request(
                    PromptRequest(rollout_id=cli.node_id, max_groups=want, version=0)
                )
            except Exception:  # an overloaded buffer: as a rollout would, ask again (counted)
                self.sent["request_failed"] += 1
                low.set()
                continue
            assert isinstance(rep, PromptReply)
            for it in rep.items:
                for s in range(it.n):
                    queue.put_nowait((it, s))
            if not rep.items:
                await asyncio.sleep(rep.retry_after_s or 0.05)
            if queue.qsize() <= most // 2:
                low.set()

    async def train(self, shard: int) -> None:
        """A synthetic trainer: takes batches and commits them, so the buffer never fills."""
        from laminar.protocol.buffer import BatchCommit, BatchReply, BatchRequest

        step, trainer, first = 0, self.trainers[shard], True
        while True:
            try:
                rep = await trainer.request(
                    BatchRequest(
                        trainer_id="trainer-0",
                        groups=TRAINER_BATCH_GROUPS,
                        trainer_version=0,
                        wait_s=0.5,
                        restart=first,
                    )
                )
                first = False
                assert isinstance(rep, BatchReply)
                self.sent["trained"] += len(rep.trajectories)
                if rep.batch_id:
                    step += 1
                    await trainer.request(BatchCommit(batch_id=rep.batch_id, step=step, version=0))
            except Exception:  # an overloaded buffer: as the trainer would, ask again (counted)
                self.sent["request_failed"] += 1

    def delivery_messages(self) -> int:
        """Messages the outboxes sent so far (a Trajectory alone or a Deliveries of several)."""
        return sum(ob.stats["messages"] for ob in self.outboxes)

    def finish(self, ci: int, t: Any) -> None:
        """Synthetic rollout `ci` finished `t`: into its outbox."""
        self.sent["trajectories"] += 1
        self.outboxes[ci].put(t)

    def trajectory(self, it: Any, s: int, rid: str) -> Any:
        from laminar.protocol.data import Trajectory

        return Trajectory(
            uid=f"{it.group_id}/{s}",
            group_id=it.group_id,
            prompt_uid=it.uid,
            sample_index=s,
            prompt_ids=it.prompt_ids,
            response_ids=self.ids,
            logprobs=self.lps,
            loss_mask=self.mask,
            version=0,
            reward=float(s % 2),
            rollout_id=rid,
            finish_reason="stop",
            timings={"gen_s": self.gen_s} if self.gen_s else {},
        )

    def batch(self, ci: int, first_fill: bool, finish: bool = True) -> Any:
        """The next PartialBatch of synthetic rollout `ci`: one entry per in-flight sample (up to
        entries_per_batch), each the sample's next entry_tokens tokens; finished samples go as
        Trajectories (finish=False: none finishes, the samples grow on: partials alone)."""
        from laminar.protocol.data import PartialBatch, PartialTrajectory

        cli, active, e = self.buf[ci], self.active[ci], self.entries_per_batch
        queue = self.queues[ci]
        while len(active) < e and not queue.empty():
            it, s = queue.get_nowait()
            if queue.qsize() <= e // 2:
                self.low[ci].set()  # its feeder asks for more
            # the first fill starts part-way (the first entry brings the tokens so far): steady
            # finishes. So does every sample of a rollout's first batch: at a low rate a rollout
            # may send its first batch after the warm-up (one every flush_s / x seconds)
            part_way = first_fill or not self.started[ci]
            c0 = self._part_way(ci) if part_way else 0
            active.append([it, s, c0, True, f"{it.group_id}/{s}"])
        if not active:
            return None
        self.started[ci] = True
        uids, offs, lens, heads, at = [], [], [], [], []
        for i, a in enumerate(active[:e]):
            it, s, c, new, uid = a
            lo, hi = (0 if new else c * self.entry_tokens), (c + 1) * self.entry_tokens
            uids.append(uid)
            offs.append(lo)
            lens.append(hi - lo)
            if new:
                at.append(i)
                heads.append(
                    PartialTrajectory(
                        uid=uid,
                        group_id=it.group_id,
                        prompt_uid=it.uid,
                        sample_index=s,
                        prompt_ids=it.prompt_ids,
                        response_ids=self.ids[:0],
                        logprobs=self.lps[:0],
                        version=0,
                        n=it.n,
                        rollout_id=cli.node_id,
                    )
                )
            a[2], a[3] = c + 1, False
        k, n = len(uids), sum(lens)
        # token values do not matter to the buffer: views of one preallocated array (the driver's
        # cost is not what is measured)
        msg = PartialBatch(
            rollout_id=cli.node_id,
            uids=uids,
            versions=np.zeros(k, np.int64),
            offsets=np.array(offs, np.int64),
            lengths=np.array(lens, np.int64),
            token_ids=self.flat_ids[:n],
            logprobs=self.flat_lps[:n],
            loss_mask=None if self.flat_mask is None else self.flat_mask[:n],
            awaiting_env=np.zeros(k, np.uint8),
            headers=heads,
            header_at=np.array(at, np.int64) if at else None,
        )
        # round robin within the rollout: the served samples go to the back; finished ones leave
        served, rest = active[:e], active[e:]
        if not finish:
            active[:] = rest + served
            return msg
        active[:] = rest + [a for a in served if a[2] < self.chunks_per_traj]
        for a in served:
            if a[2] >= self.chunks_per_traj:
                self.finish(ci, self.trajectory(a[0], a[1], cli.node_id))
        return msg

    async def stream(
        self, x: float, until: float, first_fill: bool = False, finish: bool = True
    ) -> None:
        """Paced PartialBatches at x * batches/s, rollouts in turn (see the module docstring);
        finish=False: no sample finishes (the partial stream alone)."""
        rate = x * self.rates["batches_s"]
        t_start, due_sent = time.monotonic(), 0
        while time.monotonic() < until:
            now = time.monotonic()
            due = int((now - t_start) * rate) - due_sent
            if due <= 0:
                await asyncio.sleep(0.002)
                continue
            for _ in range(min(due, 500)):
                ci = self.next_rollout
                self.next_rollout = (ci + 1) % self.rollouts
                msg = self.batch(ci, first_fill, finish)
                due_sent += 1
                if msg is None:
                    continue
                try:
                    await self.buf[ci].send(msg)
                    self.sent["batches"] += 1
                    self.sent["chunks"] += len(msg.uids)
                except Exception:
                    pass
            await asyncio.sleep(0)

    async def trajectories(self, x: float, until: float) -> None:
        """Trajectories alone at x * trajectories/s, each from a rollout drawn at random (so each
        rollout's finishes are the Poisson stream of many independent sequences, not one every
        rollouts / rate seconds): served samples finished without a partial stream (what a
        trajectory costs: intake, journal, ack, and the trainer's batches of them)."""
        rate = x * self.rates["trajectories_s"]
        t_start, done = time.monotonic(), 0
        while time.monotonic() < until:
            due = int((time.monotonic() - t_start) * rate) - done
            for _ in range(min(max(due, 0), 500)):
                ci = self.rng.randrange(self.rollouts)
                done += 1
                queue = self.queues[ci]
                if queue.empty():
                    continue
                it, s = queue.get_nowait()
                if queue.qsize() <= self.entries_per_batch // 2:
                    self.low[ci].set()
                self.finish(ci, self.trajectory(it, s, self.buf[ci].node_id))
            await asyncio.sleep(0.005)

    async def pushes(self, x: float, until: float) -> None:
        """Status pushes and the extra heartbeats above 1x (the client timers send 1x) to the
        manager."""
        rate = x * self.rates["status_pushes_s"] + max(0.0, x - 1) * self.rates["heartbeats_s"]
        t_start, done = time.monotonic(), 0
        while time.monotonic() < until:
            due = int((time.monotonic() - t_start) * rate) - done
            for _ in range(min(max(due, 0), 1000)):
                with_cli = self.mgr[done % self.rollouts]
                try:
                    await with_cli.beat(1.0)
                    self.sent["pushes"] += 1
                except Exception:
                    pass
                done += 1
            await asyncio.sleep(0.005)

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) until every trajectory finished so far was acked (the outboxes send
        what waits for a window at once meanwhile)."""
        await asyncio.gather(*(ob.flush(timeout) for ob in self.outboxes))

    async def close(self) -> None:
        for t in list(self.bg):
            t.cancel()
        for c in [*self.buf, *self.mgr, *self.trainers]:
            await c.close()


class _Counted:
    """A synthetic rollout's buffer client as its Outbox uses it: counts the trajectories each
    reply acks (or each failed request would have) and times the request (Driver.ack_lat)."""

    def __init__(self, drv: Driver, cli: Any):
        self.drv, self.cli = drv, cli

    async def request(self, msg: Any, timeout: float, retries: int) -> Any:
        n = len(getattr(msg, "trajectories", ())) + len(getattr(msg, "abandoned", ())) or 1
        t0 = time.monotonic()
        try:
            reply = await self.cli.request(msg, timeout=timeout, retries=retries)
        except Exception:
            self.drv.sent["ack_failed"] += n
            raise
        self.drv.sent["acked"] += n
        self.drv.ack_lat.append(time.monotonic() - t0)
        return reply

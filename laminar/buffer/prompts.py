"""The prompt pool: dataset rows -> PromptItems, epoch by epoch (the buffer serves them).

    pool = PromptPool(rows, encoder, shuffle=True, seed=0, epochs=None)   # laminar/data/prompts.py
    items, reason = pool.next_items(4, n=8)                  # PromptItems with unique group ids
    pool.cursor()  /  pool.restore(cursor)                   # journaled with each GroupsServed
    pool = open_pool(cfg.data, cfg.model.path, metrics, log)  # from the data section (blocking)

Rows and their encoding (file formats, uids, bad rows, chat templates) are
laminar/data/prompts.py.

Epoch e visits every row once in the order of a permutation seeded by (seed, e);
the cursor (epoch, position, serial) is what the buffer journals to resume.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import structlog

from laminar.buffer.records import PoolCursor
from laminar.config import DataConfig
from laminar.data.prompts import BadRow, PromptEncoder, PromptRow, load_prompts
from laminar.data.vision_prompts import VisionEncoder
from laminar.metrics import Metrics
from laminar.models.tiny_vlm import is_vlm
from laminar.protocol.data import PromptItem
from laminar.vision.images import image_limits

__all__ = ["PromptPool", "open_pool"]


class PromptPool:
    """Rows served epoch by epoch in a seeded order; every served group gets a unique group_id."""

    def __init__(
        self,
        rows: list[PromptRow],
        encoder: PromptEncoder | VisionEncoder,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = None,
        on_bad: Callable[[str, str], None] | None = None,
    ):
        self.rows = rows
        self.encoder = encoder
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self.on_bad = on_bad or (lambda where, why: None)
        self.epoch = 0
        self.pos = 0
        self.serial = 0
        self.bad: set[int] = set()
        """Row indices found unservable (reported once, skipped in every epoch)."""
        self.skipped = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order_epoch != epoch:
            n = len(self.rows)
            self._order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        return (
            not self.rows
            or len(self.bad) >= len(self.rows)
            or (self.epochs is not None and self.epoch >= self.epochs)
        )

    def _next_row(self) -> tuple[int, int] | None:
        """(row index, epoch) of the next row, advancing the cursor; None when exhausted."""
        if self.exhausted:
            return None
        if self.pos >= len(self.rows):
            self.epoch += 1
            self.pos = 0
            if self.exhausted:
                return None
        idx = int(self.order(self.epoch)[self.pos])
        self.pos += 1
        return idx, self.epoch

    def next_items(self, k: int, n: int) -> tuple[list[PromptItem], str]:
        """Up to k PromptItems (one group of n samples each) and, when fewer, why."""
        items: list[PromptItem] = []
        misses = 0  # a whole epoch's worth of bad rows in a row ends the search
        while len(items) < k and misses < len(self.rows):
            nxt = self._next_row()
            if nxt is None:
                break
            idx, epoch = nxt
            if idx in self.bad:
                self.skipped += 1
                misses += 1
                continue
            row = self.rows[idx]
            try:
                ids, text = self.encoder.encode(row.prompt, row.images)
            except BadRow as exc:
                self.bad.add(idx)
                self.skipped += 1
                misses += 1
                self.on_bad(row.where, str(exc))
                continue
            misses = 0
            group_id = f"{row.uid}@{epoch}#{self.serial}"
            self.serial += 1
            items.append(
                PromptItem(
                    uid=row.uid,
                    group_id=group_id,
                    prompt_ids=ids,
                    n=n,
                    prompt=text,
                    row=dict(row.row),
                    image_digests=[i.digest for i in row.images],
                    images=[i.data for i in row.images],
                )
            )
        if len(items) < k:
            return items, (
                "empty" if not self.rows or len(self.bad) >= len(self.rows) else "epochs_done"
            )
        return items, ""

    def cursor(self) -> PoolCursor:
        return PoolCursor(self.epoch, self.pos, self.serial, len(self.rows))

    def restore(self, cur: PoolCursor) -> str:
        """Resume from a journaled cursor; returns a warning when the dataset changed size."""
        self.epoch = cur.epoch
        self.pos = cur.pos
        self.serial = max(self.serial, cur.serial)
        if cur.rows >= 0 and cur.rows != len(self.rows):
            self.pos = min(self.pos, len(self.rows))
            return (
                f"dataset has {len(self.rows)} rows, the journal's cursor was taken with {cur.rows}"
            )
        return ""

    def progress(self) -> float:
        """Epochs served so far, fractional."""
        return self.epoch + (self.pos / len(self.rows) if self.rows else 0.0)


def open_pool(
    data: DataConfig,
    model_path: str | None,
    metrics: Metrics,
    log: structlog.typing.FilteringBoundLogger,
) -> PromptPool | None:
    """The prompt pool of data.train (None when unset), tokenized by the tokenizer at
    model_path (UTF-8 bytes without one). Blocking (file reads, tokenizer load): run it off
    the event loop.
    """
    if not data.train:
        return None
    rows, report = load_prompts(data.train, image_limits(data))
    for err in report.errors:
        log.warning("bad_row", error=err)
    encoder: PromptEncoder | VisionEncoder
    if model_path and is_vlm(model_path):  # the model's own processor expands placeholders
        from laminar.models.tiny_vlm import load_processor  # imports transformers: lazily

        encoder = VisionEncoder(load_processor(model_path), data.max_prompt_tokens)
    else:
        tok = None
        if model_path:
            from laminar.models.prompt_tokenizer import load_prompt_tokenizer

            tok = load_prompt_tokenizer(model_path, data.chat_template)
        else:
            log.info("byte_prompt_ids", reason="model.path not set: prompt ids are UTF-8 bytes")
        encoder = PromptEncoder(tok, data.chat_template, data.max_prompt_tokens)

    def bad_row(where: str, why: str) -> None:  # a row that fails only when first served
        metrics.count("bad_rows")
        log.warning("bad_row", error=f"{where}: {why}")

    pool = PromptPool(
        rows,
        encoder,
        shuffle=data.shuffle,
        seed=data.seed,
        epochs=data.epochs,
        on_bad=bad_row,
    )
    metrics.count("bad_rows", report.bad)
    metrics.count("bad_images", report.bad_images)
    log.info(
        "prompts_loaded",
        files=report.files,
        rows=report.rows,
        bad=report.bad,
        duplicate_uids=report.duplicate_uids,
        images=report.images,
        bad_images=report.bad_images,
        chat_template=encoder.use_template,
    )
    return pool

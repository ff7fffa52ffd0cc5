"""Paged KV cache + a ragged attention function (`attend`): HF transformers models call into it
through the attention interface, lean_forward.py calls it directly.

    cache = PagedKVCache.for_model(model, capacity_tokens=65_536, rows=32, max_len=4096)
    use_paged_attention(model)                # model.config._attn_implementation = "laminar_paged"
    cache.reserve(row, n_tokens)              # False: not enough free blocks (nothing taken)
    with cache.step(cache.step_layout(decode_pos, prefill)):  # one packed forward
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=last_idx)
    cache.release(row)                        # a sequence leaves: its blocks are free again

Why not HF's own caches: DynamicCache concatenates the whole cache on every
step (O(length) copies per token) and a static left-padded batch cannot let
sequences join and leave between steps; transformers' continuous-batching
manager owns its own thread, one generation config for all requests and no
partial state on cancel. So the engine keeps its own cache and plugs in through
the attention interface (every modern HF decoder calls `ALL_ATTENTION_FUNCTIONS`
with RoPE'd query/key/value and its `layer_idx`); HF builds no mask for a custom
implementation, so the forward costs nothing beyond the layers themselves.

Why paged (vLLM's PagedAttention): the memory is `rollout.kv_capacity_tokens`, not
max_running x max_model_len. Per layer one K and one V pool of `blocks + 1` blocks of
`block_tokens` positions, token-major (block, position, kv_head, head_dim); block 0 is the
null block, never written, that unused block-table entries point at (masked out: zeros, so
no stale value reaches a softmax). Each engine row (a running sequence; rows 0..R-1, a leaving
sequence's row is refilled by moving the last one's block table in, a few ints) has a block
table, a row of `table` (numpy, host side). A sequence takes blocks as it grows and returns
them all when it leaves, so long-tailed batches share the pool: memory follows the tokens
held, not the longest sequence allowed. When the pool covers every row at max_len (the default:
kv_capacity_tokens unset) the layout is contiguous instead: row r owns the fixed blocks
[1 + r x M, 1 + (r + 1) x M), M = ceil(max_len / block_tokens), so decode reads rows 0..d-1 as
one slice of the pool (no gather, as fast as a dense slot cache) and a moved row's positions are
copied.

A packed step holds `n_decode` one-token decode queries followed by prefill segments (one
sequence each, tokens [start, start+len)). Every token's key/value is written with one
index_copy_ per layer to its flat pool row (block x block_tokens + offset), computed once per
step (StepLayout.write_rows). Decode attention reads each decode row's first max(pos) + 1
positions, a view of the pool (contiguous) or gathered with one index_select of its blocks
(paged), masked past each row's position (no mask when every row is at the same one); a prefill
segment from position 0 attends to its own new keys (causal SDPA), one that continues a cached
prefix reads its row's positions (a view, or gathered).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from laminar.models.decoder_ops import text_config

ATTN_NAME = "laminar_paged"
BLOCK_TOKENS = 16
"""Positions per block (vLLM's default on GPU): a sequence wastes under one block at its end."""
_local = threading.local()


def pool_blocks(
    capacity_tokens: int, rows: int = 0, max_len: int = 0, block_tokens: int = BLOCK_TOKENS
) -> tuple[int, bool]:
    """(blocks, contiguous) of the pool for `capacity_tokens` positions: when they cover every
    row at max_len (the default, kv_capacity_tokens unset) each row owns a fixed contiguous range
    of ceil(max_len / block_tokens) blocks, else the blocks are shared (paged)."""
    if rows and capacity_tokens >= rows * max_len:
        return rows * -(-max_len // block_tokens), True
    return -(-capacity_tokens // block_tokens), False


def pool_positions(
    capacity_tokens: int, rows: int = 0, max_len: int = 0, block_tokens: int = BLOCK_TOKENS
) -> int:
    """Positions a pool for `capacity_tokens` allocates per layer (pool_blocks): whole blocks, +
    the null block (what laminar plan counts)."""
    return (pool_blocks(capacity_tokens, rows, max_len, block_tokens)[0] + 1) * block_tokens


@dataclass
class Segment:
    """One sequence's prefill tokens [start, start + length) in a packed step."""

    start: int
    length: int
    blocks: torch.Tensor
    """(ceil((start + length) / block_tokens),) long: its block table, read when start > 0."""
    first: int = -1
    """Contiguous layout: its row's first block (its blocks are first, first + 1, ...), else -1."""


@dataclass
class StepLayout:
    """Where the tokens of one packed forward live in the cache (PagedKVCache.step_layout)."""

    n_decode: int
    decode_pos: torch.Tensor
    """(n_decode,) long: write position (= current length) of each decode query."""
    decode_blocks: torch.Tensor
    """(n_decode * nb,) long: each decode row's first nb block ids (null-padded), row-major; empty
    in the contiguous layout (rows 0..n_decode-1 are one slice of the pool)."""
    decode_cols: int
    """max(decode_pos) + 1: the cache columns decode attention reads."""
    decode_masked: bool
    """False when every decode row is at the same position (every column read is visible)."""
    write_rows: torch.Tensor
    """(T,) long: the flat pool row (block * block_tokens + offset) each token's key/value goes
    to, decode tokens first, then the segments in order."""
    segments: list[Segment]
    _mask: torch.Tensor | None = None

    def decode_mask(self, columns: int) -> torch.Tensor:
        """(n_decode, 1, 1, columns) bool: column c is visible to row i when c <= decode_pos[i];
        built once per step and shared by every layer."""
        if self._mask is None:
            cols = torch.arange(columns, device=self.decode_pos.device)
            self._mask = (cols[None, :] <= self.decode_pos[:, None])[:, None, None, :]
        return self._mask


class PagedKVCache:
    def __init__(
        self,
        layers: int,
        *,
        blocks: int,
        rows: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_tokens: int = BLOCK_TOKENS,
        contiguous: bool = False,
    ) -> None:
        if blocks < 1 or rows < 1 or block_tokens < 1:
            raise ValueError(f"a KV cache needs blocks, rows, block_tokens >= 1: {blocks=} {rows=}")
        per_row = -(-max_len // block_tokens)
        if contiguous and blocks < rows * per_row:
            raise ValueError(
                f"a contiguous KV cache needs rows x ceil(max_len / block_tokens) = "
                f"{rows * per_row} blocks, got {blocks}"
            )
        self.contiguous = contiguous
        """Row r owns blocks [1 + r * M, 1 + (r + 1) * M) (M = table width): decode reads rows
        0..d-1 as one slice of the pool, no gather; a moved row's positions are copied."""
        if contiguous:
            blocks = rows * per_row
        self.blocks, self.block_tokens = blocks, block_tokens
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.device = torch.device(device)
        self.layers, self.dtype = layers, dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_flat: list[torch.Tensor] = []
        self.v_flat: list[torch.Tensor] = []
        self.allocate()
        self.table = np.zeros((rows, min(blocks, per_row)), np.int64)
        """Block table of each row: block ids in position order, 0 past its last block (the
        contiguous layout: its fixed range, whole)."""
        if contiguous:
            self.table[:] = 1 + np.arange(rows * per_row).reshape(rows, per_row)
        self.held = [0] * rows
        """Blocks each row holds (its table's filled prefix)."""
        # a stack, lowest id on top: a fresh cache hands out 1, 2, 3 ... (easy to read in tests)
        self._free = [] if contiguous else list(range(blocks, 0, -1))
        self._taken = 0
        """Blocks the rows hold (the contiguous layout's count; the paged one reads _free)."""
        self.layout: StepLayout | None = None

    def allocate(self) -> int:
        """(Re)create the pools, zeroed; returns their bytes. Only with no row holding blocks."""
        # Inference tensors: only ever touched under inference_mode (the forward).
        with torch.inference_mode():
            shape = (self.blocks + 1, self.block_tokens, self.kv_heads, self.head_dim)  # + null 0
            self.k = [
                torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)
            ]
            self.v = [
                torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)
            ]
        # the same pools as (rows, kv_heads, head_dim): one index_copy_ writes a step's tokens
        self.k_flat = [k.view(-1, self.kv_heads, self.head_dim) for k in self.k]
        self.v_flat = [v.view(-1, self.kv_heads, self.head_dim) for v in self.v]
        return self.nbytes

    def free(self) -> int:
        """Drop the pools (colocated sleep: the device memory goes back); returns the bytes
        freed. Only with no row holding blocks; allocate() brings them back."""
        if any(self.held):
            raise RuntimeError("PagedKVCache.free: rows still hold blocks")
        freed = self.nbytes
        self.k, self.v, self.k_flat, self.v_flat = [], [], [], []
        self.layout = None
        return freed

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        capacity_tokens: int,
        rows: int,
        max_len: int,
        block_tokens: int = BLOCK_TOKENS,
    ) -> PagedKVCache:
        """The pool for `capacity_tokens` positions (rounded up to whole blocks; pool_blocks) of
        `model`'s layers, in its parameters' dtype and device: contiguous rows when it covers
        every row at max_len."""
        cfg = text_config(model)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        p = next(model.parameters())
        blocks, contiguous = pool_blocks(capacity_tokens, rows, max_len, block_tokens)
        return cls(
            cfg.num_hidden_layers,
            blocks=blocks,
            rows=rows,
            max_len=max_len,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=p.dtype,
            device=p.device,
            block_tokens=block_tokens,
            contiguous=contiguous,
        )

    # ---- blocks ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Positions the pool holds (kv_capacity_tokens rounded up to whole blocks)."""
        return self.blocks * self.block_tokens

    @property
    def free_blocks(self) -> int:
        return self.blocks - self._taken if self.contiguous else len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (what the cache allocated)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def reserve(self, row: int, tokens: int) -> bool:
        """Give `row` blocks for its first `tokens` positions; False (and nothing taken) when too
        few blocks are free."""
        have = self.held[row]
        want = self.blocks_for(tokens)
        if want <= have:
            return True
        if want > self.table.shape[1] or want - have > self.free_blocks:
            return False
        if self.contiguous:  # its own range: the blocks are already in its table
            self._taken += want - have
            self.held[row] = want
            return True
        for i in range(have, want):
            self.table[row, i] = self._free.pop()
        self.held[row] = want
        return True

    def release(self, row: int) -> None:
        """Return row's blocks to the pool."""
        n = self.held[row]
        self.held[row] = 0
        if self.contiguous:
            self._taken -= n
            return
        self._free.extend(self.table[row, :n][::-1].tolist())
        self.table[row, :n] = 0

    def move(self, src: int, dst: int) -> None:
        """Row src's blocks become row dst's (dst released first); src is left empty. The
        contiguous layout copies src's positions into dst's range (what the slot cache did)."""
        n = self.held[src]
        if self.contiguous:
            a, b = int(self.table[src, 0]), int(self.table[dst, 0])
            with torch.inference_mode():
                for pool in self.k + self.v:
                    pool[b : b + n] = pool[a : a + n]
            self.held[dst], self.held[src] = n, 0
            return
        self.table[dst] = 0
        self.table[dst, :n] = self.table[src, :n]
        self.held[dst] = n
        self.table[src, :n] = 0
        self.held[src] = 0

    # ---- steps -------------------------------------------------------------------------
    def step_layout(
        self, decode_pos: Sequence[int], prefill: Sequence[tuple[int, int, int]]
    ) -> StepLayout:
        """The layout of one packed step: decode queries for rows 0..len(decode_pos)-1, each at
        its position (its reserved blocks must cover it), then prefill segments (row, start,
        length) in order."""
        bt, dev = self.block_tokens, self.device
        d = len(decode_pos)
        pos = np.asarray(decode_pos, np.int64)
        cols = int(pos.max()) + 1 if d else 0
        nb = self.blocks_for(cols)
        tables = self.table[:d, :nb]
        rows = [tables[np.arange(d), pos // bt] * bt + pos % bt]
        segments = []
        for row, start, n in prefill:
            blocks = self.table[row, : self.blocks_for(start + n)]
            at = np.arange(start, start + n)
            rows.append(blocks[at // bt] * bt + at % bt)
            first = int(blocks[0]) if self.contiguous else -1
            segments.append(Segment(start, n, torch.tensor(blocks, device=dev), first))
        # copies (torch.tensor), never views of the tables the scheduler goes on editing
        return StepLayout(
            d,
            torch.tensor(pos, device=dev),
            torch.tensor(tables.reshape(-1)[: 0 if self.contiguous else None], device=dev),
            cols,
            bool(d) and int(pos.min()) + 1 < cols,
            torch.tensor(np.concatenate(rows), device=dev),
            segments,
        )

    @contextmanager
    def step(self, layout: StepLayout):
        """Route the attention calls of one forward (in this thread) to this cache."""
        self.layout = layout
        _local.cache = self
        try:
            yield
        finally:
            _local.cache = None
            self.layout = None

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a step's keys and values, token-major (T, KV, D), at the layout's rows."""
        assert self.layout is not None  # inside step()
        rows = self.layout.write_rows
        self.k_flat[layer].index_copy_(0, rows, key)
        self.v_flat[layer].index_copy_(0, rows, value)

    def gather(self, layer: int, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `n` sequences' blocks (blocks: (n * nb,) ids) as (n, KV, nb *
        block_tokens, D) views, the layout SDPA reads."""
        shape = (n, -1, self.kv_heads, self.head_dim)
        k = self.k[layer].index_select(0, blocks).view(shape).transpose(1, 2)
        v = self.v[layer].index_select(0, blocks).view(shape).transpose(1, 2)
        return k, v

    def rows_view(
        self, layer: int, first: int, n: int, cols: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous layout: the first `cols` positions of the `n` rows whose blocks start at
        block `first`, as (n, KV, cols, D) views of the pools (nothing copied)."""
        m = self.table.shape[1]
        shape = (n, m * self.block_tokens, self.kv_heads, self.head_dim)
        k = self.k[layer][first : first + n * m].view(shape)[:, :cols].transpose(1, 2)
        v = self.v[layer][first : first + n * m].view(shape)[:, :cols].transpose(1, 2)
        return k, v


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: write key/value into the paged cache, attend, return (1,
    T, H, D)."""
    cache: PagedKVCache | None = getattr(_local, "cache", None)
    if cache is None or cache.layout is None:
        raise RuntimeError(
            f"{ATTN_NAME} attention called outside PagedKVCache.step() (model used outside the "
            "engine?)"
        )
    if kw.get("sliding_window") or kw.get("softcap"):
        raise NotImplementedError(
            "sliding-window / softcapped attention is not supported by the torch engine"
        )
    return attend(cache, module.layer_idx, query, key, value, scaling), None


def attend(
    cache: PagedKVCache,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Write one packed step's key/value (1, KV, T, D) into layer's pools and attend with query
    (1, H, T, D) as cache.layout places the tokens; returns (1, T, H, D)."""
    lay = cache.layout
    assert lay is not None  # inside PagedKVCache.step()
    cache.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    _, heads, t, hd = query.shape
    out = query.new_empty(1, t, heads, hd)
    d = lay.n_decode
    if d:
        out[0, :d] = _decode(cache, layer, query[0, :, :d].transpose(0, 1), scaling)
    off = d
    for seg in lay.segments:
        n = seg.length
        q = query[:, :, off : off + n]
        if seg.start == 0:
            k_new, v_new = key[:, :, off : off + n], value[:, :, off : off + n]
            o = F.scaled_dot_product_attention(
                q, k_new, v_new, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            total = seg.start + n
            if seg.first >= 0:
                k, v = cache.rows_view(layer, seg.first, 1, total)
            else:
                k, v = cache.gather(layer, seg.blocks, 1)
            qpos = torch.arange(seg.start, total, device=query.device)
            mask = torch.arange(total, device=query.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                q, k[:, :, :total], v[:, :, :total], attn_mask=mask, scale=scaling, enable_gqa=True
            )
        out[0, off : off + n] = o[0].transpose(0, 1)
        off += n
    return out


def attend_decode(
    cache: PagedKVCache,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """attend() for a step of decode queries only (no prefill segment), in the token-major layout
    a plain forward has: query (d, H, D), key and value (d, KV, D); returns (d, H, D), without
    attend()'s layout round trip."""
    assert cache.layout is not None and not cache.layout.segments  # inside step(), decode only
    cache.write(layer, key, value)
    return _decode(cache, layer, query, scaling)


def _decode(
    cache: PagedKVCache, layer: int, query: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """The decode queries of a step, token-major (d, H, D), their keys and values already written:
    one query per row over its first decode_cols positions (a slice of the pool in the contiguous
    layout, its gathered blocks in the paged one), masked past its position."""
    lay = cache.layout
    assert lay is not None
    d, cols = lay.n_decode, lay.decode_cols
    if cache.contiguous:
        k, v = cache.rows_view(layer, 1, d, cols)
    else:
        k, v = cache.gather(layer, lay.decode_blocks, d)
        k, v = k[:, :, :cols], v[:, :, :cols]
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        k,
        v,
        attn_mask=lay.decode_mask(cols) if lay.decode_masked else None,
        scale=scaling,
        enable_gqa=True,
    )
    return o.squeeze(2)


def use_paged_attention(model: Any) -> None:
    """Register the paged attention function and switch `model` to it (the model is the engine's
    now)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    try:
        model.set_attn_implementation(ATTN_NAME)
    except (AttributeError, ValueError):
        model.config._attn_implementation = ATTN_NAME

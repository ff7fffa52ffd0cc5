"""Slot KV cache + a ragged attention function (`attend`): HF transformers models call into it
through the attention interface, lean_forward.py calls it directly.

    cache = SlotKVCache.for_model(model, slots=32, max_len=1024)
    use_slot_attention(model)                 # model.config._attn_implementation = "laminar_slots"
    with cache.step(StepLayout(...)):         # one packed forward: decode tokens + prefill segments
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=last_idx)

Why not HF's own caches: DynamicCache concatenates the whole cache on every
step (O(length) copies per token) and a static left-padded batch cannot let
sequences join and leave between steps; transformers' continuous-batching
manager owns its own thread, one generation config for all requests and no
partial state on cancel. So the engine keeps its own cache and plugs in through
the attention interface (every modern HF decoder calls `ALL_ATTENTION_FUNCTIONS`
with RoPE'd query/key/value and its `layer_idx`); HF builds no mask for a custom
implementation, so the forward costs nothing beyond the layers themselves.

Layout: per layer one K and one V tensor (slots, kv_heads, max_len, head_dim).
Running sequences always occupy slots 0..R-1 (a leaving sequence's slot is
filled by moving the last one in), so a decode step reads the view K[:R, :, :Lmax]
with no gather. A packed step holds `n_decode` one-token decode queries (slots
0..n_decode-1, written at each slot's own position) followed by prefill segments
(one slot each, tokens [start, start+len)).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from laminar.models.decoder_ops import text_config

ATTN_NAME = "laminar_slots"
_local = threading.local()


@dataclass
class StepLayout:
    """Where the tokens of one packed forward live in the cache."""

    n_decode: int
    decode_pos: torch.Tensor
    """(n_decode,) long: write position (= current length) of decode slots 0..n_decode-1."""
    decode_max: int
    """max(decode_pos) + 1: how many cache columns decode attention reads."""
    segments: list[tuple[int, int, int]]
    """Prefill segments (slot, start position, length), packed after the decode tokens in order."""
    _rows: torch.Tensor | None = None
    _mask: torch.Tensor | None = None

    def decode_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, mask) of the decode queries, built once per step and shared by every layer."""
        if self._rows is None:
            dev = self.decode_pos.device
            self._rows = torch.arange(self.n_decode, device=dev)
            cols = torch.arange(self.decode_max, device=dev)
            self._mask = (cols[None, :] <= self.decode_pos[:, None])[:, None, None, :]
        assert self._mask is not None  # built together with _rows
        return self._rows, self._mask


class SlotKVCache:
    def __init__(
        self,
        layers: int,
        slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.slots, self.max_len = slots, max_len
        # Inference tensors: only ever touched under inference_mode (forward and slot moves).
        with torch.inference_mode():
            shape = (slots, kv_heads, max_len, head_dim)
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        # the same tensors as (slots, max_len, kv_heads, head_dim) views: a decode step writes each
        # token's heads at (slot, position) with one index_put_
        self.k_at = [k.transpose(1, 2) for k in self.k]
        self.v_at = [v.transpose(1, 2) for v in self.v]
        self.layout: StepLayout | None = None

    @classmethod
    def for_model(cls, model: Any, slots: int, max_len: int) -> SlotKVCache:
        cfg = text_config(model)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, slots, max_len, kv_heads, head_dim, p.dtype, p.device)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction after a leave)."""
        with torch.inference_mode():
            for k, v in zip(self.k, self.v, strict=True):
                k[dst, :, :length] = k[src, :, :length]
                v[dst, :, :length] = v[src, :, :length]

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


def slot_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: write key/value into the slot cache, attend, return (1, T,
    H, D)."""
    cache: SlotKVCache | None = getattr(_local, "cache", None)
    if cache is None or cache.layout is None:
        raise RuntimeError(
            f"{ATTN_NAME} attention called outside SlotKVCache.step() (model used outside the "
            "engine?)"
        )
    if kw.get("sliding_window") or kw.get("softcap"):
        raise NotImplementedError(
            "sliding-window / softcapped attention is not supported by the torch engine"
        )
    return attend(cache, module.layer_idx, query, key, value, scaling), None


def attend(
    cache: SlotKVCache,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Write one packed step's key/value (1, KV, T, D) into layer's slots and attend with query
    (1, H, T, D) as cache.layout places the tokens; returns (1, T, H, D)."""
    lay = cache.layout
    assert lay is not None  # inside SlotKVCache.step()
    kc, vc = cache.k[layer], cache.v[layer]
    _, heads, t, hd = query.shape
    out = query.new_empty(1, t, heads, hd)
    d = lay.n_decode
    if d:
        out[0, :d] = _decode(
            cache,
            layer,
            query[0, :, :d].transpose(0, 1),
            key[0, :, :d].transpose(0, 1),
            value[0, :, :d].transpose(0, 1),
            scaling,
        )
    off = d
    for slot, start, n in lay.segments:
        k_new, v_new = key[:, :, off : off + n], value[:, :, off : off + n]
        kc[slot, :, start : start + n] = k_new[0]
        vc[slot, :, start : start + n] = v_new[0]
        q = query[:, :, off : off + n]
        if start == 0:
            o = F.scaled_dot_product_attention(
                q, k_new, v_new, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            total = start + n
            qpos = torch.arange(start, total, device=query.device)
            mask = torch.arange(total, device=query.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                q,
                kc[slot : slot + 1, :, :total],
                vc[slot : slot + 1, :, :total],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )
        out[0, off : off + n] = o[0].transpose(0, 1)
        off += n
    return out


def attend_decode(
    cache: SlotKVCache,
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
    return _decode(cache, layer, query, key, value, scaling)


def _decode(
    cache: SlotKVCache,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """The decode queries of a step, token-major (d, H, D) / (d, KV, D): each slot's key and value
    written at its position, then one query per slot over its slot's first decode_max columns."""
    lay = cache.layout
    assert lay is not None
    rows, mask = lay.decode_index()
    cache.k_at[layer].index_put_((rows, lay.decode_pos), key)
    cache.v_at[layer].index_put_((rows, lay.decode_pos), value)
    d, n = lay.n_decode, lay.decode_max
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        cache.k[layer][:d, :, :n],
        cache.v[layer][:d, :, :n],
        attn_mask=mask,
        scale=scaling,
        enable_gqa=True,
    )
    return o.squeeze(2)


def use_slot_attention(model: Any) -> None:
    """Register the slot attention function and switch `model` to it (the model is the engine's
    now)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, slot_attention)
    try:
        model.set_attn_implementation(ATTN_NAME)
    except (AttributeError, ValueError):
        model.config._attn_implementation = ATTN_NAME

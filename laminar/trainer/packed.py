"""The trainer's packed forward: a micro-batch's tokens in one flat sequence, every distinct prompt
run once, no padding in the matmuls.

    plan = pack_by_prompt(samples, idx, micro_batch_tokens)  # trainer/packing.py: a group together
    layout = PackedLayout.build([samples[i] for i in mb])      # once per micro-batch
    logits = PackedForward(model)(layout)              # (N, V): mb.resp_mask's positions, row-major

Why: a GRPO group is n samples of one prompt, and the padded forward (HF's, over collate's
[b, L] rows) runs that prompt n times and pads every row to the longest. On the demo's batches
(prompts ~20 tokens, answers ~40, 8 a group) the prompt copies and the padding are about half
the tokens the matmuls see. Here the linear layers see each distinct prompt once and each
response once; attention, the only part that mixes tokens, runs per row (a prompt row sees its
own prompt causally, a response row its prompt and its own tokens causally) in chunks of rows of
similar length, padded only there.

Exactness: the same arithmetic as HF's forward of the padded rows (q/k/v and gate/up as one
matmul each, RoPE from HF's own table): logprobs agree to float rounding and so do gradients
(tests/test_trainer_packed.py). Models decoder_ops.unsupported() names, and FSDP-sharded ones
(whose parameters are gathered only inside their modules' forward), keep the HF forward.
LoRA (model.lora): each projection adds its peft adapter's share (models/lora.py fused_lora).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from laminar.models import decoder_ops as ops
from laminar.models.decoder_ops import DecoderShape, rms, rope_table, rotate
from laminar.models.lora import fused_lora, lora_delta
from laminar.models.moe import MoeShape, is_routed, routed_mlp
from laminar.trainer.batch import Sample
from laminar.trainer.packing import pack_micro_batches


@dataclass
class AttentionChunk:
    """Rows (a prompt, or a response after its prompt) attended in one call, padded to the
    longest."""

    q: torch.Tensor
    """[n, Qmax] packed index of each row's queries (padding repeats a real one)."""
    k: torch.Tensor
    """[n, Kmax] packed index of each row's keys/values."""
    mask: torch.Tensor
    """[n, 1, Qmax, Kmax] bool: key is real and not after the query."""
    real: torch.Tensor
    """[R] indices of the query slots (of n * Qmax) that are real tokens."""

    def to(self, device: torch.device) -> AttentionChunk:
        return AttentionChunk(
            self.q.to(device), self.k.to(device), self.mask.to(device), self.real.to(device)
        )


@dataclass
class PackedLayout:
    ids: torch.Tensor
    """[T] the distinct prompts, then every response."""
    pos: torch.Tensor
    """[T] each token's position in its own sequence (a response continues its prompt)."""
    chunks: list[AttentionChunk]
    order: torch.Tensor
    """[T] row of the chunks' concatenated outputs that holds packed token t."""
    select: torch.Tensor
    """[N] packed index of the position predicting each trained token, samples in order."""
    longest: int
    """1 + the largest position (the RoPE table's length needed)."""
    routes: torch.Tensor | None = None
    """MoE routing replay: [T, moe_layers, k] long, the rollout's expert ids of each packed token
    (a prompt's from the first of its samples that has them); None: every token routes live."""
    routed: torch.Tensor | None = None
    """[T] bool: the token has a recorded route (the others, e.g. each response's last token,
    route live)."""

    @classmethod
    def build(
        cls, samples: list[Sample], attn_tokens: int = 1024, moe: MoeShape | None = None
    ) -> PackedLayout:
        """The layout of `samples` (a micro-batch, in order); attention chunks hold about
        `attn_tokens` keys (rows x longest row). `moe`: the policy's shape, to replay the samples'
        routes (a route array that does not fit it is not replayed)."""
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        prompt_at: dict[bytes, tuple[int, int]] = {}  # prompt bytes -> (start, length)
        n_tok = 0
        for s in samples:
            key = s.prompt_ids.tobytes()
            if key not in prompt_at:
                prompt_at[key] = (n_tok, len(s.prompt_ids))
                ids.append(s.prompt_ids)
                pos.append(np.arange(len(s.prompt_ids)))
                n_tok += len(s.prompt_ids)
        rows_q: list[np.ndarray] = []  # per row: packed indices of its queries / keys
        rows_k: list[np.ndarray] = []
        for start, n in prompt_at.values():
            rows_q.append(np.arange(start, start + n))
            rows_k.append(rows_q[-1])
        select: list[np.ndarray] = []
        for s in samples:
            p_start, p_len = prompt_at[s.prompt_ids.tobytes()]
            r = len(s.response_ids)
            ids.append(s.response_ids)
            pos.append(np.arange(p_len, p_len + r))
            resp = np.arange(n_tok, n_tok + r)
            rows_q.append(resp)
            rows_k.append(np.concatenate([np.arange(p_start, p_start + p_len), resp]))
            # token j is predicted at the position before it: the prompt's last, then resp[j-1]
            before = np.concatenate([[p_start + p_len - 1], resp[:-1]])
            select.append(before if s.loss_mask is None else before[s.loss_mask])
            n_tok += r
        all_pos = np.concatenate(pos)
        chunks: list[AttentionChunk] = []
        chunk_rows: list[np.ndarray] = []
        for members in pack_micro_batches([len(k) for k in rows_k], attn_tokens):
            chunks.append(
                _chunk([rows_q[m] for m in members], [rows_k[m] for m in members], all_pos)
            )
            chunk_rows.extend(rows_q[m] for m in members)
        order = np.empty(n_tok, dtype=np.int64)
        order[np.concatenate(chunk_rows)] = np.arange(n_tok)
        routes = routed = None
        if moe is not None and any(s.routes is not None for s in samples):
            routes, routed = _packed_routes(samples, prompt_at, n_tok, moe)
        return cls(
            torch.from_numpy(np.concatenate(ids).astype(np.int64)),
            torch.from_numpy(all_pos.astype(np.int64)),
            chunks,
            torch.from_numpy(order),
            torch.from_numpy(np.concatenate(select).astype(np.int64)),
            int(all_pos.max()) + 1,
            routes,
            routed,
        )

    def to(self, device: torch.device) -> PackedLayout:
        return PackedLayout(
            self.ids.to(device),
            self.pos.to(device),
            [c.to(device) for c in self.chunks],
            self.order.to(device),
            self.select.to(device),
            self.longest,
            None if self.routes is None else self.routes.to(device),
            None if self.routed is None else self.routed.to(device),
        )


def _packed_routes(
    samples: list[Sample], prompt_at: dict[bytes, tuple[int, int]], n_tok: int, moe: MoeShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed token's recorded route and whether it has one: a prompt's positions from the
    first of its samples with routes, a response's from its own (positions past its routes, and
    samples whose routes do not fit `moe`, route live)."""
    routes = np.zeros((n_tok, len(moe.layers), moe.top_k), np.int64)
    routed = np.zeros(n_tok, bool)
    filled: set[bytes] = set()
    at = sum(n for _, n in prompt_at.values())  # responses follow the distinct prompts
    for s in samples:
        key = s.prompt_ids.tobytes()
        p_start, p_len = prompt_at[key]
        r = len(s.response_ids)
        rt = s.routes
        if rt is not None and moe.check(rt, p_len + r) is None:
            if key not in filled:
                k = min(p_len, len(rt))
                routes[p_start : p_start + k], routed[p_start : p_start + k] = rt[:k], True
                filled.add(key)
            k = max(0, min(r, len(rt) - p_len))
            routes[at : at + k], routed[at : at + k] = rt[p_len : p_len + k], True
        at += r
    return torch.from_numpy(routes), torch.from_numpy(routed)


def _chunk(qs: list[np.ndarray], ks: list[np.ndarray], pos: np.ndarray) -> AttentionChunk:
    n, q_max, k_max = len(qs), max(len(q) for q in qs), max(len(k) for k in ks)
    q_idx = np.empty((n, q_max), dtype=np.int64)
    k_idx = np.zeros((n, k_max), dtype=np.int64)
    q_real = np.zeros((n, q_max), dtype=bool)
    k_real = np.zeros((n, k_max), dtype=bool)
    for r, (q, k) in enumerate(zip(qs, ks, strict=True)):
        q_idx[r, : len(q)], q_idx[r, len(q) :] = q, q[-1]  # padded queries repeat the last real one
        k_idx[r, : len(k)] = k
        q_real[r, : len(q)], k_real[r, : len(k)] = True, True
    # within a row positions are distinct and increasing, so "not after the query" is causality
    mask = k_real[:, None, :] & (pos[k_idx][:, None, :] <= pos[q_idx][:, :, None])
    return AttentionChunk(
        torch.from_numpy(q_idx),
        torch.from_numpy(k_idx),
        torch.from_numpy(mask[:, None]),
        torch.from_numpy(np.flatnonzero(q_real.reshape(-1))),
    )


class PackedForward:
    """Logits of a PackedLayout's selected positions under `model` (an HF Llama-family
    ForCausalLM, or a Qwen3-MoE / Mixtral one), computed from the model's own parameters so
    gradients reach them. A routed MLP replays the layout's routes (models/moe.py routed_mlp)."""

    def __init__(self, model: Any, fp32_head: bool = False) -> None:
        self.model = model
        self.shape = DecoderShape.of(model)
        self.moe = MoeShape.of(model)
        """The MoE shape (None: dense); PackedLayout.build takes it to replay routes."""
        self.moe_slot = {layer: i for i, layer in enumerate(self.moe.layers)} if self.moe else {}
        """Decoder layer index -> its index in a route array's layer axis."""
        self.live_routes: list[torch.Tensor] = []
        """The expert ids each MoE layer used in the last forward (tests, the mismatch bench)."""
        self.cos, self.sin = rope_table(
            model, 512
        )  # grown on demand (a long-context model's full table is large)
        self.fp32_head = fp32_head
        """Project to the vocabulary in float32 under autocast (as the trainer's HF head does)."""

    def __call__(self, lay: PackedLayout) -> torch.Tensor:
        h = self.hidden(lay)
        head = self.model.lm_head.weight
        if self.fp32_head:
            with torch.autocast(h.device.type, enabled=False):
                return F.linear(h.float(), head.float())
        return F.linear(h, head)

    def hidden(self, lay: PackedLayout, checkpoint: bool = False) -> torch.Tensor:
        """(N, D): the final-norm hidden state at the selected positions (what the head projects).
        `checkpoint`: each decoder layer's activations are recomputed in backward, not kept."""
        inner, sh = self.model.model, self.shape
        longest = lay.longest
        if longest > self.cos.shape[0]:
            self.cos, self.sin = rope_table(self.model, max(longest, 2 * self.cos.shape[0]))
        cos, sin = self.cos[lay.pos][:, None], self.sin[lay.pos][:, None]
        x = F.embedding(lay.ids, inner.embed_tokens.weight)
        self.live_routes = []
        for i, layer in enumerate(inner.layers):
            # the recorded routes go in as an argument: a checkpointed layer recomputes in
            # backward with the same experts
            forced = None
            if lay.routes is not None and i in self.moe_slot:
                forced = lay.routes[:, self.moe_slot[i]]
            if checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    self._layer, layer, x, cos, sin, lay, forced, use_reentrant=False
                )
            else:
                x = self._layer(layer, x, cos, sin, lay, forced)
        return rms(x[lay.select], inner.norm.weight, sh.eps)

    def _layer(
        self,
        layer: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lay: PackedLayout,
        forced: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sh = self.shape
        t = x.shape[0]
        h_q, h_kv, d = sh.heads, sh.kv_heads, sh.head_dim
        rope = h_q + h_kv
        a, m = layer.self_attn, layer.mlp
        y = rms(x, layer.input_layernorm.weight, sh.eps)
        w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        b = (
            None
            if a.q_proj.bias is None
            else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        )
        qkv = _plus(F.linear(y, w, b), fused_lora((a.q_proj, a.k_proj, a.v_proj), y))
        qkv = qkv.view(t, rope + h_kv, d)
        qk, v = qkv[:, :rope], qkv[:, rope:]
        if getattr(a, "q_norm", None) is not None:
            qk = torch.cat(
                [
                    rms(qk[:, :h_q], a.q_norm.weight, sh.eps),
                    rms(qk[:, h_q:], a.k_norm.weight, sh.eps),
                ],
                1,
            )
        qk = rotate(qk, cos, sin)
        o = self._attend(qk[:, :h_q], qk[:, h_q:], v, lay)
        x = x + _plus(F.linear(o, a.o_proj.weight, a.o_proj.bias), lora_delta(a.o_proj, o))
        y = rms(x, layer.post_attention_layernorm.weight, sh.eps)
        if is_routed(m):
            out, idx = routed_mlp(m, y, forced, lay.routed if forced is not None else None)
            self.live_routes.append(idx.detach())
            return x + out
        gate_up = F.linear(y, torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        gate, up = _plus(gate_up, fused_lora((m.gate_proj, m.up_proj), y)).chunk(2, -1)
        h = sh.act(gate) * up
        return x + _plus(F.linear(h, m.down_proj.weight), lora_delta(m.down_proj, h))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PackedLayout
    ) -> torch.Tensor:
        """(T, H*D): each packed token's attention output, row by row as the layout's chunks say."""
        sh = self.shape
        outs = []
        for c in lay.chunks:
            o = F.scaled_dot_product_attention(
                q[c.q].transpose(1, 2),
                k[c.k].transpose(1, 2),
                v[c.k].transpose(1, 2),
                attn_mask=c.mask,
                scale=sh.scaling,
                enable_gqa=sh.kv_heads != sh.heads,
            )
            outs.append(o.transpose(1, 2).reshape(-1, sh.heads * sh.head_dim)[c.real])
        return torch.cat(outs)[lay.order]


def _plus(x: torch.Tensor, lora: torch.Tensor | None) -> torch.Tensor:
    """A projection plus its LoRA adapter's share, where it has one (model.lora)."""
    return x if lora is None else x + lora


def packed_forward(model: Any, max_len: int, choice: str, sharded: bool) -> PackedForward | None:
    """The forward the trainer runs (`trainer.forward`): the packed one, or None (HF's padded
    one)."""

    def why_not() -> str | None:
        return "FSDP-sharded parameters" if sharded else ops.unsupported(model, max_len)

    if ops.use_plain_forward("trainer.forward", choice, "packed", why_not):
        return PackedForward(model)
    return None

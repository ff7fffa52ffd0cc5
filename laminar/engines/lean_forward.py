"""A lean decoder forward for the torch engine: Llama-family layers as plain tensor ops over the
paged KV cache.

    lean = lean_decoder(model, max_len, "auto")   # None when the model is not one it can run
    with cache.step(layout):
        logits = lean(ids, pos, keep, cache)       # (len(keep), vocab), like HF's logits_to_keep
    lean.refresh()                                  # after the model's weights change in place

Why: the engine's models are small and its decode steps are short, so much of a step is the
per-op overhead of the HF module tree (kwarg checks, output capture, module hooks, a rotary
table recomputed every call): about a fifth of a decode step on the demo's 3-layer policy.
This forward runs the same arithmetic as ~20 tensor ops a layer: q/k/v and gate/up fused
into one matmul each, the residual adds inside the o/down matmuls (addmm), one-call RMSNorm,
RoPE read from a table built once (rotate_half's sign folded into it: roll + addcmul), and
attention through kv_cache.attend (the function the HF path plugs in), or, on a step of
decode queries only, kv_cache.attend_decode (the same writes and attention call in the
token-major layout, without the layout round trip). bench/engine.py measures it against the
same engine on the HF forward.

On a small model a step costs per op more than per token: a decode step of the demo's 3-layer
policy takes ~0.28 ms of CPU with 1 sequence and ~1.0 ms with 32, 1.37x and 1.19x less than
before the addmm residuals, the one-call norm, the three-op RoPE and attend_decode (bench/README.md,
"The state since the fourth session").

What it runs: Llama, Mistral (no sliding window within max_len), Qwen2 (q/k/v biases) and
Qwen3 (q/k RMSNorm on the head dimension), with any static RoPE type; Qwen3-MoE and Mixtral too,
their routed MLPs through models/moe.py routed_mlp (HF's router weight and experts module), which
hands back each token's top-k expert ids (the rollout's routes). Anything else
(dynamic RoPE, sliding windows, soft caps, other layer shapes) gets None from lean_decoder (auto)
and the engine runs the HF forward. The weights stay the model's own tensors; only the fused
q/k/v and gate/up copies are built here (a second copy of about two thirds of the layer
weights: `rollout.torch_forward: hf` where memory is tight), and refresh() rebuilds them
after a weight load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from laminar.engines.kv_cache import PagedKVCache, attend, attend_decode
from laminar.models import decoder_ops as ops
from laminar.models.decoder_ops import DecoderShape, rms, rope_table, rotate
from laminar.models.moe import is_routed, routed_mlp


@dataclass
class _Layer:
    attn: Any
    mlp: Any
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LeanDecoder:
    def __init__(self, model: Any, max_len: int) -> None:
        inner = model.model
        self.shape = DecoderShape.of(model)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [
            _Layer(
                layer.self_attn,
                layer.mlp,
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                getattr(getattr(layer.self_attn, "q_norm", None), "weight", None),
                getattr(getattr(layer.self_attn, "k_norm", None), "weight", None),
            )
            for layer in inner.layers
        ]
        self.cos, self.sin = rope_table(model, max_len)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused q/k/v and gate/up weights from the model's (after a weight load)."""
        qkv, gate_up = [], []
        with torch.inference_mode():
            for ly in self.layers:
                a, m = ly.attn, ly.mlp
                bias = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                qkv.append(
                    (
                        torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                        None if bias[0] is None else torch.cat(bias),
                    )
                )
                # a routed MLP (MoE) runs HF's own router weight and experts: nothing to fuse
                routed = is_routed(m)
                gate_up.append(
                    None if routed else torch.cat([m.gate_proj.weight, m.up_proj.weight])
                )
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = qkv
        self.gate_up: list[torch.Tensor | None] = gate_up

    def release(self) -> None:
        """Drop the fused copies (colocated sleep); refresh() rebuilds them from the model's."""
        self.qkv, self.gate_up = [], []

    def nbytes(self) -> int:
        """Bytes of the fused copies."""
        parts = [t for w, b in self.qkv for t in (w, b) if t is not None]
        parts += [t for t in self.gate_up if t is not None]  # a routed MLP (MoE) has none
        return sum(t.numel() * t.element_size() for t in parts)

    def fused_views(self) -> dict[int, torch.Tensor]:
        """What this forward actually multiplies by, keyed by the data_ptr of the model tensor
        each part was copied from: the q/k/v and gate/up rows of the fused copies (attestation
        reads these back, not the model's own tensors)."""
        out: dict[int, torch.Tensor] = {}
        for ly, (w, b), gu in zip(self.layers, self.qkv, self.gate_up, strict=True):
            a, m = ly.attn, ly.mlp
            parts = [a.q_proj, a.k_proj, a.v_proj]
            rows = [p.weight.shape[0] for p in parts]
            for p, view in zip(parts, torch.split(w, rows), strict=True):
                out[p.weight.data_ptr()] = view
            if b is not None:
                for p, view in zip(parts, torch.split(b, rows), strict=True):
                    out[p.bias.data_ptr()] = view
            if gu is None:  # routed: the model's own expert tensors
                continue
            gate = m.gate_proj.weight.shape[0]
            out[m.gate_proj.weight.data_ptr()] = gu[:gate]
            out[m.up_proj.weight.data_ptr()] = gu[gate:]
        return out

    def __call__(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        keep: torch.Tensor,
        cache: PagedKVCache,
        routes: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (len(keep), vocab) of one packed step: ids, pos (T,) long, placed as cache.layout
        says. `routes`: a list that receives each MoE layer's expert ids (T, k), in layer order."""
        t = ids.shape[0]
        sh = self.shape
        h_q, h_kv, d = sh.heads, sh.kv_heads, sh.head_dim
        rope = h_q + h_kv  # q and k heads, rotated together
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        assert cache.layout is not None  # inside PagedKVCache.step()
        decode_only = not cache.layout.segments
        x = F.embedding(ids, self.embed)
        for i, ly in enumerate(self.layers):
            y = rms(x, ly.norm_in, sh.eps)
            qkv = F.linear(y, *self.qkv[i]).view(t, rope + h_kv, d)
            qk, v = qkv[:, :rope], qkv[:, rope:]
            if ly.q_norm is not None and ly.k_norm is not None:
                qk = torch.cat(
                    [rms(qk[:, :h_q], ly.q_norm, sh.eps), rms(qk[:, h_q:], ly.k_norm, sh.eps)], 1
                )
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :h_q], qk[:, h_q:]
            if decode_only:
                o = attend_decode(cache, i, q, k, v, sh.scaling)
            else:
                o = attend(
                    cache,
                    i,
                    q.transpose(0, 1)[None],
                    k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    sh.scaling,
                )
            x = _residual(x, o.reshape(t, h_q * d), ly.attn.o_proj.weight, ly.attn.o_proj.bias)
            y = rms(x, ly.norm_post, sh.eps)
            gu = self.gate_up[i]
            if gu is None:
                out, idx = routed_mlp(ly.mlp, y)
                x = x + out
                if routes is not None:
                    routes.append(idx)
                continue
            gate, up = F.linear(y, gu).chunk(2, -1)
            x = _residual(x, sh.act(gate) * up, ly.mlp.down_proj.weight, None)
        return F.linear(rms(x[keep], self.norm, sh.eps), self.lm_head)


def _residual(
    x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    """x + linear(h, w, b), the projection and the residual add in one matmul call where no bias."""
    return torch.addmm(x, h, w.t()) if b is None else x + F.linear(h, w, b)


def lean_decoder(model: Any, max_len: int, forward: str) -> LeanDecoder | None:
    """The forward the engine steps with (`rollout.torch_forward`): the lean one, or None (HF's)."""
    if ops.use_plain_forward(
        "rollout.torch_forward", forward, "lean", lambda: ops.unsupported(model, max_len)
    ):
        return LeanDecoder(model, max_len)
    return None

"""The Llama-family decoder arithmetic shared by the plain-tensor forwards (the torch engine's
lean decode step, the trainer's packed forward): which HF models they can run exactly, the
model's shape, its RoPE table, and the norm and rotation as HF computes them.

    why = unsupported(model, max_len)     # None: Llama, Mistral, Qwen2 or Qwen3 with a static RoPE
    shape = DecoderShape.of(model)
    cos, sin = rope_table(model, max_len) # (max_len, head_dim), HF's own rotary module (sin signed)
    y = rms(x, weight, shape.eps)
    qk = rotate(qk, cos[pos][:, None], sin[pos][:, None])

Both forwards read the weights from the HF module tree (model.model.layers[i].self_attn.q_proj ...),
so anything unsupported() lets through has exactly these parameters and no others that act.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from laminar.models.moe import is_routed

log = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
"""What the plain-tensor forwards run; the MoE ones (models/moe.py) route their MLPs through HF's
own router weights and experts module."""
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def text_config(model: Any) -> Any:
    """The decoder's config of an HF model (a multimodal model's text part, else model.config)."""
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


@dataclass(frozen=True)
class DecoderShape:
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, model: Any) -> DecoderShape:
        cfg = text_config(model)
        layer0 = model.model.layers[0]
        heads = int(cfg.num_attention_heads)
        return cls(
            eps=float(cfg.rms_norm_eps),
            heads=heads,
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            scaling=float(layer0.self_attn.scaling),
            act=F.silu if cfg.hidden_act == "silu" else layer0.mlp.act_fn,
        )


def rope_table(model: Any, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (max_len, head_dim) for positions 0..max_len-1, asked once of HF's own rotary module
    (the same values it computes per call, whatever the RoPE type's scaling); sin comes signed for
    rotate() (signed_sin)."""
    p = model.model.embed_tokens.weight
    with torch.no_grad():
        positions = torch.arange(max_len, device=p.device)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=p.dtype, device=p.device), positions)
    return cos[0], signed_sin(sin[0])


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, back to the input dtype, then scale. All float32: one
    call with the weight (the same products, x * rstd * w, without three Python-level ops)."""
    if x.dtype == w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate_half's sign folded in (first half negated), as rotate() takes it."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's half-split layout, x * cos + rotate_half(x) * sin, in three ops: rotate_half(x)
    * sin is roll(x, half) * signed_sin(sin) term by term; addcmul may fuse the multiply-add (a
    rounding apart)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """RoPE settings from either config layout (transformers 5: rope_parameters with rope_theta in
    it; 4.x: rope_theta + rope_scaling), rope_type always set."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = dict(params) if isinstance(params, dict) else {"rope_type": "?"}
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def config_unsupported(cfg: Any, max_len: int) -> str | None:
    """What in a decoder's config the plain-tensor forwards cannot run exactly, or None."""
    kind = getattr(cfg, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} is not one of {MODEL_TYPES}"
    rope_type = rope_parameters(cfg)["rope_type"]
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} is not a static one {STATIC_ROPE}"
    window = getattr(cfg, "sliding_window", None)
    if (
        window
        and (getattr(cfg, "use_sliding_window", True) or kind == "mistral")
        and window < max_len
    ):
        return f"sliding window {window} < max_len {max_len}"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


def unsupported(model: Any, max_len: int) -> str | None:
    """Why the plain-tensor forwards cannot run `model` exactly, or None when they can."""
    why = config_unsupported(text_config(model), max_len)
    if why is not None:
        return why
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
        return "not a ForCausalLM with model.{embed_tokens, layers, norm, rotary_emb}"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return f"attention {type(a).__name__} lacks q/k/v/o projections"
        if (a.q_proj.bias is None) != (a.k_proj.bias is None):
            return "unexpected projection biases"
        if is_routed(m):
            continue
        if (
            not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
            or m.down_proj.bias is not None
        ):
            return f"MLP {type(m).__name__} is not a bias-free gated MLP"
        if m.gate_proj.bias is not None:
            return "unexpected projection biases"
    return None


def use_plain_forward(
    setting: str, choice: str, insist: str, why_not: Callable[[], str | None]
) -> bool:
    """Whether `setting` (auto | `insist` | hf) runs a plain-tensor forward: "auto" takes it where
    `why_not()` finds nothing against it (else HF's forward, the reason logged), `insist` raises
    the reason instead, "hf" declines."""
    if choice == "hf":
        return False
    if choice not in ("auto", insist):
        raise ValueError(f"{setting} must be auto, {insist} or hf, not {choice!r}")
    why = why_not()
    if why is None:
        return True
    if choice == insist:
        raise ValueError(f"{setting}={insist} cannot run this model: {why}")
    log.info("%s: HF forward (%s)", setting, why)
    return False

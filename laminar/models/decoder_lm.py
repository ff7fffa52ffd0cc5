"""A Llama-family causal LM loaded without transformers: the HF module tree's names and
parameters, read straight from config.json + safetensors, for processes whose forward is one of
the plain-tensor ones (the torch engine's lean decode step, the trainer's packed forward); it
also has a plain padded forward of its own (`model(input_ids, attention_mask).logits`).

    model = load_decoder_lm(path, "float32", "cpu")    # None: not one it loads exactly (use HF)
    model.state_dict().keys() == HF's           # model.layers.0.self_attn.q_proj.weight, ...
    model.save_pretrained(out, state_dict=sd)   # config.json + model.safetensors, as HF writes them

Why: importing transformers' model code costs ~2.1 CPU-seconds in every process that loads a
model (each rollout, the trainer), all at the same moment on the demo's 2-core box, before the
first step can run. Those forwards read only the parameters (decoder_ops.unsupported's list),
so the modules here carry just those, under HF's names, and a checkpoint written here loads in
transformers (tests/test_decoder_lm.py checks both ways, the RoPE table and the logits against
HF's).

What it loads: model_type llama, mistral, qwen2, qwen3 with SiLU MLPs and default, linear or
llama3 RoPE, no sliding window inside max_len, every safetensors name matching. Anything else
returns None and the caller loads through transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from laminar.models.decoder_ops import (
    DecoderShape,
    config_unsupported,
    rms,
    rope_parameters,
    rotate,
    signed_sin,
)
from laminar.models.moe import MOE_TYPES

ROPE_TYPES = ("default", "linear", "llama3")
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def inverse_frequencies(cfg: Any, head_dim: int) -> torch.Tensor:
    """The RoPE inverse frequencies of the default, linear and llama3 types (float32)."""
    p = rope_parameters(cfg)
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if p["rope_type"] == "linear":
        return inv / p["factor"]
    if p["rope_type"] == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        blend = (old_len / wavelen - lo) / (hi - lo)
        between = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(between, (1 - blend) * scaled / factor + blend * scaled, scaled)
    return inv


class RotaryTable(nn.Module):
    """(cos, sin) of positions, as HF's rotary module returns them: (batch, T, head_dim)."""

    def __init__(self, cfg: Any, head_dim: int) -> None:
        super().__init__()
        self.inv_freq = nn.Buffer(inverse_frequencies(cfg, head_dim), persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, bias: dict[str, bool], qk_norm: bool) -> None:
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        self.q_proj = nn.Linear(d, h * head_dim, bias=bias["q_proj"])
        self.k_proj = nn.Linear(d, kv * head_dim, bias=bias["k_proj"])
        self.v_proj = nn.Linear(d, kv * head_dim, bias=bias["v_proj"])
        self.o_proj = nn.Linear(h * head_dim, d, bias=bias["o_proj"])
        self.scaling = head_dim**-0.5
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)


class GatedMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, bias: dict[str, bool], qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, head_dim, bias, qk_norm)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderStack(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, bias: dict[str, bool], qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, head_dim, bias, qk_norm) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryTable(cfg, head_dim)


class DecoderLM(nn.Module):
    """HF's ForCausalLM module tree for the Llama family: its names and parameters, and a plain
    padded forward; the engines and the trainer mostly run their own (lean, packed) on it."""

    def __init__(
        self,
        cfg: Any,
        raw: dict[str, Any],
        bias: dict[str, bool],
        qk_norm: bool,
        generation: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.raw_config = raw
        """config.json as read (save_pretrained writes it back with the saved dtype)."""
        self.generation_config = SimpleNamespace(**generation) if generation else None
        self._generation = generation
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.model = DecoderStack(cfg, self.head_dim, bias, qk_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tie_weights(self) -> None:
        """Share the embedding with the head again (after a load that assigned new tensors)."""
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> SimpleNamespace:
        """HF's call for right-padded rows, `.logits` (b, L, V): positions 0..L-1, causal attention
        over the real tokens (the trainer's padded path and tests; the engines use their own)."""
        sh = DecoderShape.of(self)
        b, n = input_ids.shape
        cos, sin = self.model.rotary_emb(
            self.model.embed_tokens.weight, torch.arange(n, device=input_ids.device)[None]
        )
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # (1, 1, L, D): over rows and heads
        mask = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        x = self.model.embed_tokens(input_ids)
        layers: list[Any] = list(self.model.layers)
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            y = layer.input_layernorm(x)
            q = a.q_proj(y).view(b, n, sh.heads, sh.head_dim).transpose(1, 2)
            k = a.k_proj(y).view(b, n, sh.kv_heads, sh.head_dim).transpose(1, 2)
            v = a.v_proj(y).view(b, n, sh.kv_heads, sh.head_dim).transpose(1, 2)
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            o = F.scaled_dot_product_attention(
                rotate(q, cos, sin),
                rotate(k, cos, sin),
                v,
                attn_mask=mask,
                scale=sh.scaling,
                enable_gqa=sh.kv_heads != sh.heads,
            )
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            y = layer.post_attention_layernorm(x)
            x = x + m.down_proj(m.act_fn(m.gate_proj(y)) * m.up_proj(y))
        return SimpleNamespace(logits=self.lm_head(self.model.norm(x)))

    def save_pretrained(
        self,
        out: str | Path,
        state_dict: dict[str, torch.Tensor] | None = None,
        safe_serialization: bool = True,
    ) -> None:
        """config.json (+ generation_config.json) and model.safetensors as transformers writes
        them: a tied head is stored once, under the embedding's name."""
        from safetensors.torch import save_file

        if not safe_serialization:
            raise ValueError("DecoderLM writes safetensors only")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        sd = self.state_dict() if state_dict is None else state_dict
        if self.tied:
            sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
        dtypes = {v.dtype for v in sd.values()}
        raw = dict(self.raw_config)
        if len(dtypes) == 1:
            raw["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        if self._generation:
            (out / "generation_config.json").write_text(
                json.dumps(self._generation, indent=2) + "\n"
            )
        save_file(
            {k: v.detach().contiguous() for k, v in sd.items()},
            str(out / WEIGHTS),
            metadata={"format": "pt"},
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def _why_not(cfg: Any, raw: dict[str, Any], max_len: int) -> str | None:
    """What keeps the checkpoint from loading here: what the plain forwards cannot run, and the
    parts of HF's tree this one does not build (RoPE types beyond three, other activations,
    quantisation)."""
    why = config_unsupported(cfg, max_len)
    if why is not None:
        return why
    if cfg.model_type in MOE_TYPES:
        return "a mixture-of-experts model (its MLPs stay HF's modules)"
    if rope_parameters(cfg)["rope_type"] not in ROPE_TYPES:
        return f"rope_type {rope_parameters(cfg)['rope_type']!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if "quantization_config" in raw:
        return "quantized checkpoint"
    return None


def _weight_names(d: Path) -> list[Path] | None:
    index = _read_json(d / INDEX)
    if index is not None:
        return sorted({d / f for f in index.get("weight_map", {}).values()})
    return [d / WEIGHTS] if (d / WEIGHTS).exists() else None


def load_decoder_lm(
    path: str | Path, dtype: str = "float32", device: str = "cpu", max_len: int | None = None
) -> DecoderLM | None:
    """The model at `path` as a DecoderLM, or None when it is not one this loads exactly (the
    caller loads it through transformers). `max_len`: the longest sequence it will see (a
    sliding window shorter than that needs HF's attention)."""
    from safetensors.torch import load_file

    d = Path(path)
    raw = _read_json(d / "config.json")
    files = _weight_names(d)
    if raw is None or files is None or not all(f.exists() for f in files):
        return None
    fields = {
        "num_key_value_heads": raw.get("num_attention_heads"),
        "pad_token_id": None,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "model_type": None,
        **raw,
    }
    cfg = SimpleNamespace(**fields)
    # a length unknown to the caller and the config: any sliding window binds
    longest = max_len or raw.get("max_position_embeddings") or 1 << 30
    if _why_not(cfg, raw, longest) is not None:
        return None
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    p0 = "model.layers.0.self_attn."
    bias = {n: f"{p0}{n}.bias" in state for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    qk_norm = f"{p0}q_norm.weight" in state
    with torch.device("meta"):
        model = DecoderLM(cfg, raw, bias, qk_norm, _read_json(d / "generation_config.json"))
    want = set(model.state_dict())
    if model.tied:
        state.pop("lm_head.weight", None)
        want.discard("lm_head.weight")
    if set(state) != want:  # a name this tree does not have, or one it lacks: not ours to load
        return None
    torch_dtype = getattr(torch, dtype)
    model.load_state_dict(
        {k: v.to(torch_dtype) for k, v in state.items()}, strict=False, assign=True
    )
    model.tie_weights()
    # the table built on the meta device holds no values
    model.model.rotary_emb = RotaryTable(cfg, model.head_dim)
    return model.to(device).eval()


def load_model(
    path: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    module_free: bool = True,
    max_len: int | None = None,
    attention: str = "eager",
) -> Any:
    """The model at `path` for a plain-tensor forward: a DecoderLM where `module_free` and it loads
    exactly, else the HF model (transformers imported only then) with HF's `attention`
    implementation."""
    from laminar.models.tiny_vlm import is_vlm, load_vlm

    if is_vlm(path):  # HF's own forward: the pixel inputs go through the vision tower
        return load_vlm(path, dtype, device, attention)
    model = load_decoder_lm(path, dtype, device, max_len) if module_free else None
    if model is None:
        from laminar.models.tiny import load_causal_lm

        model = load_causal_lm(path, dtype, device, attention)
    return model

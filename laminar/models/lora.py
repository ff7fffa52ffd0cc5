"""LoRA adapters on a Llama-family decoder, in peft's format from the trainer to the export.

    add_adapters(model, lora)             # trainer: peft's LoRA layers on the targets, base frozen
    sd = adapter_state(model)             # a weight version: peft's adapter tensors (collective
                                          # under FSDP2: every rank calls it, rank 0 keeps them)
    load_adapter_state(model, sd)         # resume: a checkpoint's adapter back into the layers
    extra = fused_lora((a.q_proj, a.k_proj, a.v_proj), y)  # the plain forwards: the adapters' share
    merged = MergedAdapter(model, lora)   # engines: a version merged into a pristine base copy
    merged.apply(named_tensors)           # names, shapes, values checked first: AdapterRejected
    write_adapter_dir(out, lora, sd, base_path)  # adapter_config.json + adapter_model.safetensors
    export_merged(base_path, adapter_dir, out)    # optional: a plain HF model, adapter merged in
    lora_footprint(config_json, lora)     # trainable params, bytes, AdamW state: the memory plan

A version's tensors are named exactly as peft saves an adapter
(`base_model.model.<module>.lora_A.weight`, `... .lora_B.weight`), so the tensors the relay tier
carries, the snapshots and the checkpoint's adapter directory are one format, and
`PeftModel.from_pretrained(base, dir)` loads any of them (tests/test_lora.py checks the logits).

The trainer injects peft's own layers (`peft.inject_adapter_in_model`) into the module-free
DecoderLM or HF's model alike; the packed training forward reads the same layers' A, B, scaling
and dropout through `fused_lora`, so both forwards train one set of parameters. The engines never
import peft: they merge W = W0 + alpha/r * B @ A from a pristine copy W0 of each target weight, so
a version never drifts from rounding a previous merge back out, and a decode step costs what the
base model's does (bench/lora.py measures merged against unmerged).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from laminar.config import LoraConfig
from laminar.models.rejected import WeightsRejected

PREFIX = "base_model.model."
"""What peft puts before a module's name in a saved adapter (PeftModel -> LoraModel -> model)."""
ADAPTER = "default"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
INIT_SEED = 0
"""A is drawn from a fixed seed: every FSDP rank and every fresh start get the same adapter."""
METADATA_KEY = "laminar_lora"
"""safetensors metadata of a snapshot holding adapters: the LoraConfig as JSON."""


class AdapterRejected(WeightsRejected):
    """A version's adapter does not fit this model (names, shapes, non-finite values): nothing was
    applied and the engine still serves its previous version."""


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def target_linears(model: nn.Module, lora: LoraConfig) -> dict[str, nn.Linear]:
    """The linear layers `lora.target_modules` names, by module path, in model order."""
    wanted = set(lora.target_modules)
    found = {
        name: m
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in wanted
        and isinstance(m, nn.Linear)
        and not in_vision_tower(name)
    }
    if not found:
        raise ValueError(
            f"model.lora.target_modules {lora.target_modules} match no linear layer of the model"
        )
    return found


TOWER_PATTERN = r"(.*\.)?visual(\..*)?"
"""Module paths inside a vision-language model's vision tower (HF Qwen2-VL's `model.visual`):
LoRA applies to the language model only, the tower stays frozen (peft's exclude_modules)."""


def in_vision_tower(name: str) -> bool:
    return "visual" in name.split(".")


def version_names(module: str) -> tuple[str, str]:
    """The (A, B) tensor names of a version for the target at `module`."""
    return f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"


# ---- the trainer's side ---------------------------------------------------------------------


class GradOnlyDropout(nn.Module):
    """Dropout on the adapter's input in gradient passes only: the no-grad passes (pi_prox, the
    reference) and the rollouts see the adapter the trainer's step describes."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, training=torch.is_grad_enabled())


def peft_config(lora: LoraConfig, base_path: str | None = None) -> Any:
    """peft's LoraConfig for these settings (what adapter_config.json holds)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def add_adapters(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Inject peft's LoRA layers into `model` (DecoderLM or HF's) and freeze everything else.
    Call before FSDP sharding. B starts at zero: the adapted model is the base until trained."""
    from peft import inject_adapter_in_model

    target_linears(model, lora)  # a clear error before peft's
    model.requires_grad_(False)
    config = peft_config(lora)
    if any(in_vision_tower(n) for n, _ in model.named_modules()):
        config.exclude_modules = TOWER_PATTERN  # a VLM: adapters on its language model only
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for m in model.modules():
        drops = getattr(m, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict) and ADAPTER in drops and lora.dropout > 0:
            drops[ADAPTER] = GradOnlyDropout(lora.dropout)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return model


def _version_name(param_name: str) -> str:
    return PREFIX + param_name.replace(f".{ADAPTER}.", ".")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names. Under FSDP2 every rank must call it (each
    adapter parameter is gathered in turn; only they are, never the base)."""
    out = {}
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[_version_name(name)] = full.detach()
    return out


def load_adapter_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy saved adapter tensors into the injected layers (before sharding); every adapter
    parameter must be given, and nothing else."""
    params = {_version_name(n): p for n, p in model.named_parameters() if is_adapter_name(n)}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.dtype))


def lora_delta(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A peft LoRA layer's adapter output for input x (dropout, A, B, scaling), else None."""
    m: Any = module  # peft's layer: lora_A / lora_B / lora_dropout ModuleDicts, scaling a dict
    lora_a = getattr(m, "lora_A", None)
    if not isinstance(lora_a, nn.ModuleDict) or ADAPTER not in lora_a:
        return None
    a, b = m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight
    return F.linear(F.linear(m.lora_dropout[ADAPTER](x), a), b) * m.scaling[ADAPTER]


def fused_lora(modules: Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor | None:
    """The adapters' share of a fused projection (q/k/v, gate/up: the base matmul over the
    concatenated weights), concatenated the same way; None when none of them has an adapter."""
    mods: list[Any] = list(modules)
    parts = [lora_delta(m, x) for m in mods]
    if all(p is None for p in parts):
        return None
    return torch.cat(
        [
            p if p is not None else x.new_zeros(*x.shape[:-1], int(m.weight.shape[0]))
            for m, p in zip(mods, parts, strict=True)
        ],
        -1,
    )


# ---- the engines' side ----------------------------------------------------------------------


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


def validate_adapter(
    named: Mapping[str, Any], lora: LoraConfig, shapes: Mapping[str, tuple[int, int]] | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) per target module of a version, or AdapterRejected naming what is wrong.

    `shapes`: (in, out) of every target module by path, all of which must be there; None when
    the model is not at hand (vLLM): the modules are then those the names give, each a target."""
    if shapes is None:
        modules = {n.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for n in named}
        strays = sorted(m for m in modules if m.rsplit(".", 1)[-1] not in lora.target_modules)
        if strays or not named:
            raise AdapterRejected(f"adapter modules {strays[:2]} are not in model.lora's targets")
        expected = {version_names(m)[i] for m in modules for i in (0, 1)}
    else:
        modules = set(shapes)
        expected = {version_names(m)[i] for m in shapes for i in (0, 1)}
    missing, unexpected = sorted(expected - set(named)), sorted(set(named) - expected)
    if missing or unexpected:
        raise AdapterRejected(
            f"adapter names do not match model.lora's targets: {len(missing)} missing "
            f"{missing[:2]}, {len(unexpected)} unexpected {unexpected[:2]}"
        )
    staged = {}
    r = lora.rank
    for module in sorted(modules):
        a_name, b_name = version_names(module)
        a, b = _as_tensor(named[a_name]), _as_tensor(named[b_name])
        i, o = shapes[module] if shapes is not None else (a.shape[-1], b.shape[0])
        if tuple(a.shape) != (r, i) or tuple(b.shape) != (o, r):
            raise AdapterRejected(
                f"{module}: A {tuple(a.shape)} / B {tuple(b.shape)}, expected {(r, i)} / "
                f"{(o, r)} (model.lora.rank {r})"
            )
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise AdapterRejected(f"{module}: the adapter holds NaN or inf")
        staged[module] = (a, b)
    return staged


def served_factors(named: Iterable[tuple[str, Any]], lora: LoraConfig) -> list[tuple[str, Any]]:
    """A version's adapter as an engine multiplies by it, the form attestation digests: A as
    published, B times alpha/rank in its own dtype. vLLM folds the scale into B when it loads an
    adapter (LoRALayerWeights.optimize), so this is what its LoRA slots hold; the trainer digests
    the same form of what it publishes (docs/DESIGN.md, "Attested versions")."""
    scale = lora.alpha / lora.rank
    out: list[tuple[str, Any]] = []
    for name, value in named:
        t = _as_tensor(value)
        out.append((name, t * scale if ".lora_B." in name and scale != 1 else t))
    return out


def config_target_shapes(cfg: Mapping[str, Any], lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every target module of a Llama-family config.json, by module path (the HF
    tree: model.layers.N.self_attn.q_proj, ... .mlp.down_proj)."""
    shapes = _linear_shapes(cfg)
    out = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for name in lora.target_modules:
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out[f"model.layers.{layer}.{block}.{name}"] = shapes[name]
    return out


class MergedAdapter:
    """Serves adapter versions on a plain model by merging them into its target weights:
    W = W0 + alpha/r * B @ A, W0 a pristine copy of the base kept from construction."""

    def __init__(self, model: nn.Module, lora: LoraConfig) -> None:
        self.lora = lora
        self.scale = lora.alpha / lora.rank
        self.targets = target_linears(model, lora)
        with torch.no_grad():
            self.pristine = {n: m.weight.detach().clone() for n, m in self.targets.items()}
        self.expected = {version_names(n)[i]: n for n in self.targets for i in (0, 1)}
        self.params = sum(
            lora.rank * (m.in_features + m.out_features) for m in self.targets.values()
        )
        """Adapter parameters of one version."""
        self.served: list[tuple[str, Any]] | None = None
        """The factors merged now, in served_factors' form (what attestation digests; None: the
        base)."""

    def validate(self, named: Mapping[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) per target module, or AdapterRejected naming what is wrong; touches nothing."""
        shapes = {n: (m.in_features, m.out_features) for n, m in self.targets.items()}
        return validate_adapter(named, self.lora, shapes)

    def apply(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """Merge one version into the target weights (all of them, or none on AdapterRejected)."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        staged = self.validate(dict(items))
        # copies: the version's tensors may view the relay's segment, released after the load
        factors = [
            (n, t.detach().clone())
            for m, ab in staged.items()
            for n, t in zip(version_names(m), ab, strict=True)
        ]
        self.served = served_factors(factors, self.lora)
        with torch.no_grad():
            for module, (a, b) in staged.items():
                w0 = self.pristine[module]
                a32 = a.to(device=w0.device, dtype=torch.float32)
                b32 = b.to(device=w0.device, dtype=torch.float32)
                merged = torch.addmm(w0.float(), b32, a32, alpha=self.scale)
                self.targets[module].weight.copy_(merged.to(w0.dtype))

    def reset(self) -> None:
        """Back to the base model (version 0)."""
        self.served = None
        with torch.no_grad():
            for module, lin in self.targets.items():
                lin.weight.copy_(self.pristine[module])


# ---- files ----------------------------------------------------------------------------------


def write_adapter_dir(
    out: str | Path,
    lora: LoraConfig,
    tensors: Mapping[str, torch.Tensor],
    base_path: str | None = None,
) -> Path:
    """A peft adapter directory: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base_path), indent=2) + "\n")
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def adapter_config(lora: LoraConfig, base_path: str | None = None) -> dict[str, Any]:
    """adapter_config.json's content: the fields of peft's LoraConfig that describe this adapter
    (peft fills the rest with its defaults; vLLM reads the same ones), without importing peft."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def read_adapter_dir(path: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(settings, tensors) of a peft LoRA adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    raw = json.loads((path / CONFIG_FILE).read_text())
    lora = LoraConfig(
        rank=int(raw["r"]),
        alpha=int(raw["lora_alpha"]),
        dropout=float(raw.get("lora_dropout") or 0.0),
        target_modules=sorted(raw["target_modules"]),
    )
    return lora, load_file(str(path / WEIGHTS_FILE))


def export_merged(base_path: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """A plain HF model directory: the base with the adapter merged in (W0 + alpha/r * B @ A),
    its tokenizer files copied; for serving without LoRA support."""
    import shutil

    from laminar.models.decoder_lm import load_model

    lora, tensors = read_adapter_dir(adapter_dir)
    model = load_model(base_path, "float32", "cpu")
    MergedAdapter(model, lora).apply(tensors)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(base_path).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return out


def snapshot_metadata(lora: LoraConfig | None) -> dict[str, str] | None:
    """What a snapshot file of adapter tensors carries so it can be merged without the config."""
    return None if lora is None else {METADATA_KEY: lora.model_dump_json()}


def lora_of_metadata(metadata: Mapping[str, str] | None) -> LoraConfig | None:
    raw = (metadata or {}).get(METADATA_KEY)
    return None if raw is None else LoraConfig.model_validate_json(raw)


# ---- sizes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraFootprint:
    """What LoRA costs the trainer and the weights channel for one model shape."""

    params: int
    """Trainable adapter parameters."""
    param_bytes: int
    """Their fp32 master copy (the trainer keeps fp32 master weights)."""
    grad_bytes: int
    """Their fp32 gradients."""
    optimizer_bytes: int
    """AdamW state: two fp32 moments per adapter parameter."""
    version_bytes: int
    """One published version at the rollout dtype."""
    base_params: int
    """The frozen model's parameters (no gradient, no optimizer state)."""


def _linear_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    d, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or d // heads)
    return {  # (in, out)
        "q_proj": (d, heads * hd),
        "k_proj": (d, kv * hd),
        "v_proj": (d, kv * hd),
        "o_proj": (heads * hd, d),
        "gate_proj": (d, inter),
        "up_proj": (d, inter),
        "down_proj": (inter, d),
    }


def lora_footprint(
    cfg: Mapping[str, Any], lora: LoraConfig, rollout_dtype_bytes: int = 2
) -> LoraFootprint:
    """LoRA's sizes for a Llama-family config.json (a dict), without building the model: the
    memory plan's input (trainable params, their grads and AdamW state; a version's bytes)."""
    shapes = _linear_shapes(cfg)
    layers = int(cfg["num_hidden_layers"])
    params = layers * sum(
        lora.rank * (i + o) for n, (i, o) in shapes.items() if n in lora.target_modules
    )
    d, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * d
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or d // heads)
    if cfg.get("model_type") == "qwen2":  # q/k/v biases
        per_layer += (heads + 2 * kv) * hd
    tied = bool(cfg.get("tie_word_embeddings", False))
    base = layers * per_layer + vocab * d * (1 if tied else 2) + d
    return LoraFootprint(
        params=params,
        param_bytes=4 * params,
        grad_bytes=4 * params,
        optimizer_bytes=8 * params,
        version_bytes=rollout_dtype_bytes * params,
        base_params=base,
    )

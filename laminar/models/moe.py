"""Mixture-of-Experts decoders (HF Qwen3-MoE and Mixtral layouts): their shape, the routed MLP
both plain-tensor forwards run, and routes (the top-k expert ids of each token in each MoE layer).

    shape = MoeShape.of(model)                    # None: a dense model
    out, idx = routed_mlp(layer.mlp, y)           # live top-k: the rollout records idx
    out, idx = routed_mlp(layer.mlp, y, forced, have)   # the trainer replays recorded ids

Dataflow of a route (rollout routing replay, R3, arXiv 2510.11370):

    torch engine step (lean forward) ──idx per MoE layer──► TokenEvent.routes (positions a..b)
        ──rollout SeqState.routes (first record of each position kept)──► Trajectory.routes
        [tokens x moe_layers x k, route_dtype] ──buffer (shape / ids checked)──► trainer Sample
        ──PackedLayout (per packed token)──► routed_mlp(forced): the recorded experts, gate
        weights recomputed from the live router logits (softmax, gather, renormalised where the
        model's norm_topk_prob says), so the router still gets gradients.

Why the weights are recomputed and not replayed: the selection is what the two engines disagree
on (a near-tie flips under bf16 vs fp32, batch shape, kernel choice); the weights are a smooth
function of the logits and must carry the trainer's gradient into the router.

A route covers the tokens the engine ran through the model: the prompt (its prefill) and every
response token but the last (the last is sampled, never fed back). Positions without a recorded
route (the last token; environment tokens appended after the rollout's last forward) route live;
none of them changes a trained logprob except through positions after it, which have routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the buffer checks routes against MoeShape and imports no torch
    import torch

MOE_TYPES = ("qwen3_moe", "mixtral")
ROUTE_DTYPES = ("uint8", "int16")
"""Wire dtypes of a route array: the smallest integer type that holds the expert count."""


def route_dtype(experts: int) -> np.dtype:
    """uint8 up to 256 experts, int16 up to 32768."""
    if experts <= 256:
        return np.dtype(np.uint8)
    if experts <= 32768:
        return np.dtype(np.int16)
    raise ValueError(f"{experts} experts: routes hold at most 32768")


@dataclass(frozen=True)
class MoeShape:
    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token goes to."""
    layers: tuple[int, ...]
    """Indices of the decoder layers whose MLP is routed (the others are dense)."""
    norm_topk_prob: bool
    """The top-k gate weights are renormalised to sum to 1."""
    expert_intermediate: int
    """Each expert's MLP width."""

    @property
    def dtype(self) -> np.dtype:
        return route_dtype(self.experts)

    @classmethod
    def of_config(cls, cfg: Any) -> MoeShape | None:
        """From an HF config or a config.json dict (its text part); None for a dense model."""

        def get(key: str, default: Any = None) -> Any:
            return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)

        text = get("text_config")
        if text is not None:
            return cls.of_config(text)
        kind = get("model_type")
        n_layers = int(get("num_hidden_layers") or 0)
        if kind == "qwen3_moe":
            # transformers 5 writes num_experts to config.json as num_local_experts
            experts = int(get("num_experts") or get("num_local_experts") or 0)
            step = int(get("decoder_sparse_step") or 1)
            dense = set(get("mlp_only_layers") or [])
            layers = tuple(
                i for i in range(n_layers) if i not in dense and experts > 0 and (i + 1) % step == 0
            )
            return cls(
                experts,
                int(get("num_experts_per_tok")),
                layers,
                bool(get("norm_topk_prob", False)),
                int(get("moe_intermediate_size")),
            )
        if kind == "mixtral":
            return cls(
                int(get("num_local_experts")),
                int(get("num_experts_per_tok")),
                tuple(range(n_layers)),
                True,
                int(get("intermediate_size")),
            )
        return None

    @classmethod
    def of(cls, model: Any) -> MoeShape | None:
        cfg = model.config
        return cls.of_config(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)

    def check(self, routes: np.ndarray, tokens: int) -> str | None:
        """Why `routes` cannot be a route array of a sequence of `tokens` tokens, or None."""
        want = (len(self.layers), self.top_k)
        if routes.ndim != 3 or tuple(routes.shape[1:]) != want:
            return f"routes shape {routes.shape}: want (tokens, {want[0]}, {want[1]})"
        if routes.shape[0] > tokens:
            return f"routes cover {routes.shape[0]} positions of a {tokens}-token sequence"
        if routes.size and (int(routes.min()) < 0 or int(routes.max()) >= self.experts):
            return f"expert ids outside [0, {self.experts})"
        return None


def is_routed(mlp: Any) -> bool:
    """An HF sparse MoE block (router `gate` with a weight, `experts`)."""
    return hasattr(mlp, "experts") and hasattr(getattr(mlp, "gate", None), "top_k")


def routed_mlp(
    block: Any,
    y: torch.Tensor,
    forced: torch.Tensor | None = None,
    have: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (T, D), expert ids (T, k)) of an HF sparse MoE block on tokens y (T, D), with HF's
    arithmetic: router logits, softmax in float32, top-k, renormalise where the model does, the
    block's own experts module. `forced` (T, k) long: use these experts instead of the top-k
    (where `have` (T,) bool, when given, is set; elsewhere the live top-k); the gate weights are
    the live softmax at the forced ids, so gradients reach the router either way."""
    import torch
    import torch.nn.functional as F

    router = block.gate
    logits = F.linear(y, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if forced is None:
        idx = torch.topk(probs, router.top_k, dim=-1).indices
    else:
        idx = (
            forced
            if have is None
            else torch.where(have[:, None], forced, probs.topk(router.top_k, dim=-1).indices)
        )
    weights = probs.gather(1, idx)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return block.experts(y, idx, weights.to(logits.dtype)), idx


def moe_parameter_count(shape: MoeShape, hidden: int) -> tuple[int, int]:
    """(expert parameters, router parameters) of the whole model: gate/up/down of every expert of
    every MoE layer, and each MoE layer's router (experts x hidden)."""
    per_expert = 3 * hidden * shape.expert_intermediate
    n = len(shape.layers)
    return n * shape.experts * per_expert, n * shape.experts * hidden


class RouteTap:
    """One engine step's routes: `layers` receives each MoE layer's expert ids (T, k) in layer
    order, from the lean forward directly or, given the HF `model` it runs, from forward hooks on
    its routers (their third output: the top-k ids)."""

    def __init__(self, shape: MoeShape, model: Any = None) -> None:
        self.shape = shape
        self.layers: list[torch.Tensor] = []
        if model is not None:
            for i in shape.layers:
                router = model.model.layers[i].mlp.gate
                router.register_forward_hook(self._hook)

    def _hook(self, _module: Any, _args: Any, out: Any) -> None:
        self.layers.append(out[2])

    def begin(self) -> None:
        self.layers = []

    def end(self) -> np.ndarray:
        """(T, moe_layers, k) in the route dtype; numpy, owned (the events share slices of it)."""
        import torch

        if len(self.layers) != len(self.shape.layers):
            raise RuntimeError(
                f"a step recorded {len(self.layers)} MoE layers' routes, the model has "
                f"{len(self.shape.layers)}"
            )
        dt = torch.uint8 if self.shape.dtype == np.uint8 else torch.int16
        out = torch.stack(self.layers, 1).to(dt).cpu().numpy()
        self.layers = []
        return out


ROUTES_KWARG = "laminar_routes"
"""The keyword HF's forward passes on to every decoder layer (its **kwargs) to replay routes:
`model(input_ids=..., laminar_routes=(routes [b, L, moe_layers, k] long, have [b, L] bool))`."""


class _Forcing:
    """The expert ids one routed MLP must use in the decoder layer's current forward."""

    def __init__(self) -> None:
        self.ids: tuple[torch.Tensor, torch.Tensor] | None = None
        """((T, k) forced ids, (T,) bool: the token has a recorded route), or None: live."""


def replay_in_hf_forward(model: Any, shape: MoeShape) -> int:
    """Make HF's forward (the padded one, which FSDP-sharded runs take) replay routes given as
    `model(..., laminar_routes=(routes, have))`; returns the routed layers patched.

    Each routed decoder layer's forward takes the pair from its keyword arguments (HF hands its
    forward's **kwargs to every layer) and its MLP runs routed_mlp on its slice, as the packed
    forward does. Call it before activation checkpointing wraps the layers: the checkpoint then
    keeps the pair as an argument of the layer's forward and recomputes it with the same experts.
    FSDP2's hooks sit on the layer's __call__, outside these forwards, so the MLP reads the
    gathered parameters."""
    layers = [m for m in model.modules() if is_routed(getattr(m, "mlp", None))]
    if len(layers) != len(shape.layers):
        raise RuntimeError(
            f"{len(layers)} routed layers found, the config says {len(shape.layers)}"
        )
    for slot, layer in enumerate(layers):
        block, forcing = layer.mlp, _Forcing()
        block_inner, layer_inner = block.forward, layer.forward

        def block_forward(
            h: torch.Tensor, _b: Any = block, _f: _Forcing = forcing, _i: Any = block_inner
        ) -> torch.Tensor:
            if _f.ids is None:
                return _i(h)
            out, _ = routed_mlp(_b, h.reshape(-1, h.shape[-1]), *_f.ids)
            return out.view(h.shape)

        def layer_forward(
            *args: Any, _s: int = slot, _f: _Forcing = forcing, _i: Any = layer_inner, **kwargs: Any
        ) -> Any:
            given = kwargs.pop(ROUTES_KWARG, None)
            if given is None:
                return _i(*args, **kwargs)
            routes, have = given
            _f.ids = (routes[:, :, _s].reshape(-1, routes.shape[-1]), have.reshape(-1))
            try:
                return _i(*args, **kwargs)
            finally:
                _f.ids = None

        block.forward = block_forward  # these instances only
        layer.forward = layer_forward
    return len(layers)

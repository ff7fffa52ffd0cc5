"""Attested versions on vLLM, the worker's side: fold what vLLM's model serves, in the trainer's
names and layout, so the rollout can compute the digest the trainer published for the version.

    # in the worker (LaminarWorkerExtension, vllm_ext.py), through collective_rpc:
    with folding_packed_weights():               # around every laminar load (CPU backend)
        worker.reload_weights(...)
    weight_records(model, [(name, shape), ...])  # full versions: one record per HF tensor
    adapter_records(lora_manager, id, names, r)  # model.lora: the adapter's LoRA slot
    # in the rollout (vllm_engine.py): records_digest(records) == the trainer's digest

vLLM does not serve the tensors the trainer exports: it fuses q/k/v into qkv_proj and gate/up
into gate_up_proj, pads the vocabulary rows of embed_tokens / lm_head, ties lm_head to the
embedding, and on its CPU backend repacks every linear weight into a oneDNN (or AMX) layout,
leaving a 0-element parameter behind. The canonical form undoes the first three without copies:
each HF tensor is the row block of its fused parameter (model.packed_modules_mapping names the
parts, the layer's output_sizes their rows) or the first rows of a padded one, and each block is
folded (laminar/weights/digest.py tensor_fold) where it lies. A repacked weight cannot be read
back, so it is folded at the moment vLLM packs it, from the very tensor the packed copy is made
of (folding_packed_weights wraps vLLM's dispatch_cpu_unquantized_gemm during laminar loads); a
later change to the packed copy itself is not seen. Only the records (name, dtype, shape, two
integers) cross the RPC; the sums travel as strings (they may pass 2^64).

LoRA versions: vLLM folds alpha/rank into B when it loads an adapter and copies A and B into the
slot the adapter is active in (lora_a_stacked / lora_b_stacked, rank-padded, one slice per fused
part); the records are those slots' first `rank` rows / columns, under peft's names, which the
trainer matches by digesting its version in the same form (models/lora.py served_factors).

Tensor or pipeline parallel workers each hold a shard: not attested (records None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from laminar.weights.digest import FoldRecord, fold_record

PEFT_PREFIX = "base_model.model."
_FOLD = [False]
"""Set during laminar loads: fold linear weights as vLLM's CPU backend packs them."""

WireRecord = list[Any]
"""A FoldRecord as collective_rpc returns it: [name, dtype, shape, "sum", "weighted sum"]."""


def _wire(r: FoldRecord) -> WireRecord:
    return [r[0], r[1], list(r[2]), str(r[3]), str(r[4])]


def from_wire(r: Sequence[Any]) -> FoldRecord:
    return str(r[0]), str(r[1]), tuple(int(d) for d in r[2]), int(r[3]), int(r[4])


def _missing(name: str) -> WireRecord:
    """The record of a tensor vLLM does not hold: never equal to a real one."""
    return [name, "missing", [], "0", "0"]


@contextlib.contextmanager
def folding_packed_weights() -> Iterator[None]:
    """While loading: every linear weight vLLM's CPU backend packs (and then drops) is folded
    first, by the row blocks of its fused parts, and kept on the layer (_laminar_folds)."""
    try:
        import vllm.model_executor.layers.utils as vllm_utils
    except ImportError:  # no vLLM here (a fake in tests): nothing is packed
        yield
        return
    dispatch = vllm_utils.dispatch_cpu_unquantized_gemm
    if not getattr(dispatch, "laminar_folds", False):

        def folding_dispatch(layer: Any, remove_weight: bool) -> None:
            w = getattr(layer, "weight", None)
            if _FOLD[0] and remove_weight and w is not None and w.ndim == 2 and not w.is_meta:
                layer._laminar_folds = _row_block_folds(layer)
            dispatch(layer, remove_weight)

        folding_dispatch.laminar_folds = True  # type: ignore[attr-defined]
        vllm_utils.dispatch_cpu_unquantized_gemm = folding_dispatch
    _FOLD[0] = True
    try:
        yield
    finally:
        _FOLD[0] = False


def _row_blocks(layer: Any, rows: int) -> list[tuple[int, int]]:
    """(start, stop) rows of each fused part of a layer's weight (the whole when not fused)."""
    sizes = [int(s) for s in getattr(layer, "output_sizes", None) or []]
    if sum(sizes) != rows:
        return [(0, rows)]
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def _row_block_folds(layer: Any) -> dict[tuple[str, int, int], FoldRecord]:
    """Records of the weight's (and bias's) row blocks, keyed (attribute, start, stop): the
    bias too, because the AMX path turns a bf16 bias into fp32 as it packs."""
    out = {}
    rows = int(layer.weight.shape[0])
    for attr in ("weight", "bias"):
        t = getattr(layer, attr, None)
        if t is None or t.ndim == 0 or t.shape[0] != rows:
            continue
        for a, b in _row_blocks(layer, rows):
            out[attr, a, b] = fold_record("", t[a:b])
    return out


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _submodule(model: Any, path: str) -> Any:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return getattr(module, "base_layer", module)  # a LoRA wrapper: the layer it wraps


def _locate(model: Any, name: str) -> tuple[Any, str, int, int] | None:
    """(layer, attribute, first row, row count or -1 for all) of an HF tensor in vLLM's model."""
    path, attr = name.rsplit(".", 1)
    layer = _submodule(model, path)
    if layer is not None and getattr(layer, attr, None) is not None:
        return layer, attr, 0, -1
    parent, _, leaf = path.rpartition(".")
    for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf not in parts:
            continue
        layer = _submodule(model, f"{parent}.{fused}" if parent else fused)
        if layer is None or getattr(layer, attr, None) is None:
            continue
        sizes = [int(s) for s in getattr(layer, "output_sizes", None) or []]
        i = list(parts).index(leaf)
        if len(sizes) != len(parts):
            return None
        return layer, attr, sum(sizes[:i]), sizes[i]
    return None


def weight_records(model: Any, wanted: Sequence[Sequence[Any]]) -> list[WireRecord]:
    """One record per (HF name, HF shape) in `wanted`, folded from what vLLM serves."""
    out: list[WireRecord] = []
    for name, shape in wanted:
        shape = [int(d) for d in shape]
        where = _locate(model, str(name))
        if where is None:
            out.append(_missing(name))
            continue
        layer, attr, start, count = where
        t = getattr(layer, attr)
        stop = start + count if count >= 0 else (shape[0] if shape else 0)
        packed = (getattr(layer, "_laminar_folds", None) or {}).get((attr, start, stop))
        if packed is not None and (t.numel() == 0 or packed[1] != _dtype(t)):  # repacked
            out.append(_wire((str(name), *packed[1:])))
            continue
        if count >= 0:
            t = t[start : start + count]
        elif shape and t.ndim == len(shape) and t.shape[0] > shape[0]:
            t = t[: shape[0]]  # vocabulary padding rows: not part of the model
        out.append(_wire(fold_record(str(name), t)))
    return out


def adapter_records(
    manager: Any, lora_id: int, names: Sequence[str], rank: int
) -> list[WireRecord]:
    """One record per peft tensor name of the adapter `lora_id`, read from its LoRA slot."""
    try:
        slot = list(manager.lora_index_to_id).index(lora_id)
    except ValueError:  # not active: nothing of it is served
        return [_missing(n) for n in names]
    packed = getattr(manager.model, "packed_modules_mapping", None) or {}
    out: list[WireRecord] = []
    for name in names:
        module, _, kind = name.removeprefix(PEFT_PREFIX).partition(".lora_")
        layer, part = manager.modules.get(module), 0
        if layer is None:
            parent, _, leaf = module.rpartition(".")
            for fused, parts in packed.items():
                if leaf in parts and f"{parent}.{fused}" in manager.modules:
                    layer, part = manager.modules[f"{parent}.{fused}"], list(parts).index(leaf)
                    break
        if layer is None or part >= len(layer.lora_a_stacked):
            out.append(_missing(name))
            continue
        if kind.startswith("A"):
            t = layer.lora_a_stacked[part][slot, 0, :rank, :]
        else:
            t = layer.lora_b_stacked[part][slot, 0, :, :rank]
        out.append(_wire(fold_record(name, t)))
    return out

"""A tiny HF-format causal LM with a character-level tokenizer, built locally (no hub).

    path = build_tiny_model("/tmp/tiny", alphabet="0123456789+=;#", hidden=64, layers=2)
    model = load_causal_lm(path)          # the normal transformers loading path
    tok = load_tokenizer(path)            # a real tokenizer.json (fast tokenizer)

The tokenizer maps each character to one id (plus <pad> <bos> <eos> <unk>), is
saved as tokenizer.json + tokenizer_config.json and loads with
AutoTokenizer.from_pretrained like any other. Tests use random weights; the demo
warms the model up with supervised demonstrations.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
_LOAD_LOCK = threading.Lock()
IMPORT_LOCK = threading.Lock()
"""Held while a thread imports transformers: its lazy top-level module, imported from two threads at
once (a node's import prefetch and a model or tokenizer load), can hand one of them a half-built
module ("cannot import name 'AutoModelForCausalLM'")."""
DEFAULT_ALPHABET = "0123456789+-*=;#:,. abcdefghijklmnopqrstuvwxyz?\n"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A PreTrainedTokenizerFast with one token per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    return tok


def tiny_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 512,
    kind: str = "dense",
    experts: int = 8,
    experts_per_token: int = 2,
    expert_intermediate: int | None = None,
    **kw: Any,
):
    """A small Llama-style config (RMSNorm, RoPE, SwiGLU, GQA, tied embeddings); `kind` "moe": the
    Qwen3-MoE shape of it (q/k norms, every MLP a routed one of `experts` experts, top
    `experts_per_token`, renormalised gate weights, each expert `expert_intermediate` wide,
    default hidden)."""
    from transformers import LlamaConfig

    if kind == "moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a PretrainedConfig kwarg
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            intermediate_size=intermediate or hidden * 3,
            moe_intermediate_size=expert_intermediate or hidden,
            num_experts=experts,
            num_experts_per_tok=experts_per_token,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            **kw,
        )
    if kind != "dense":
        raise ValueError(f"model kind {kind!r}: dense or moe")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate or hidden * 3,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **kw,
    )


def build_tiny_model(
    path: str | os.PathLike, alphabet: str = DEFAULT_ALPHABET, seed: int = 0, **cfg_kw: Any
) -> Path:
    """Write a randomly initialised tiny model + tokenizer to `path` (HF directory)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer(alphabet)
    config = tiny_config(len(tok), **cfg_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "laminar_tiny.json").write_text(
        json.dumps({"alphabet": alphabet, "seed": seed, **cfg_kw})
    )
    return out


def load_tokenizer(path: str | os.PathLike):
    # the lock covers the load too: it imports the tokenizer's modules lazily, and the prefetch
    # thread may be importing the same ones
    with IMPORT_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_causal_lm(
    path: str | os.PathLike, dtype: str = "float32", device: str = "cpu", attention: str = "eager"
):
    """Load a local HF causal LM (never from the hub), eval mode, on `device`. `attention`: HF's
    attn_implementation (the trainer's sdpa keeps no [rows, heads, L, L] weights for backward)."""
    import torch

    with IMPORT_LOCK:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # one load at a time per process: transformers builds the model under a process-wide
    # meta-device context, and two loads in threads (rollouts starting together) break each other;
    # the import lock too: from_pretrained imports the model's config and modeling modules lazily
    # (and through them tokenizers), which a node's import prefetch may be importing right then
    with _LOAD_LOCK, IMPORT_LOCK:
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype=getattr(torch, dtype),
            local_files_only=True,
            attn_implementation=attention,
        )
    return model.to(device).eval()


def empty_causal_lm(path: str | os.PathLike, attention: str = "eager") -> Any:
    """The HF causal LM of `path`'s config.json on the meta device: its shapes, no bytes, nothing
    read or initialised (the weights come later: a sharded checkpoint's shards, each rank its own).
    Fill the parameters with `to_empty`, then `fill_buffers`."""
    import torch

    with IMPORT_LOCK:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=attention
            )
    return model.eval()


def computed_buffers(model: Any) -> list[Any]:
    """The modules whose buffers are computed, not stored (not in the state dict): a checkpoint
    cannot fill them. Raises where `fill_buffers` could not recompute one."""
    stored = set(model.state_dict())
    out = []
    for name, module in model.named_modules():
        own = [f"{name}.{b}" if name else b for b, _ in module.named_buffers(recurse=False)]
        if all(b in stored for b in own):
            continue
        if not hasattr(module, "original_inv_freq"):  # HF's rotary embeddings: see fill_buffers
            raise ValueError(f"{type(module).__name__} ({name}) has a buffer no checkpoint holds")
        out.append(module)
    return out


def fill_buffers(model: Any, modules: list[Any]) -> None:
    """Recompute the computed buffers of `modules` (from `computed_buffers`) after `to_empty`:
    HF's own initialiser for them (rotary frequencies), which touches no parameter."""
    for module in modules:
        model._init_weights(module)


def open_model(model_or_path: Any, tokenizer: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a local HF directory, or a model already loaded (its tokenizer as
    given)."""
    if isinstance(model_or_path, str | bytes) or hasattr(model_or_path, "__fspath__"):
        return load_causal_lm(model_or_path), tokenizer or load_tokenizer(model_or_path)
    return model_or_path, tokenizer

"""The tokenizer a node needs when it renders no chat template, without transformers when the
model directory allows.

    tok = load_prompt_tokenizer(path, chat_template=cfg.data.chat_template)
    tok("12 13", add_special_tokens=False)["input_ids"];  tok.bos_token_id;  tok.chat_template
    tok.decode(ids, skip_special_tokens=True);  tok.eos_token_id

The buffer only encodes prompts; a rollout only decodes completions. Loading a tokenizer through
transformers' AutoTokenizer imports transformers' model code: 2-3 CPU-seconds at every node
start, on a 2-core demo box where every node is starting at the same moment. A directory with a
`tokenizer.json` and no chat template (or a run that turned templates off) is read with the
`tokenizers` library alone, the very same backend as the fast HF tokenizer
(`tests/test_prompt_tokenizer.py` checks ids and decoded text against AutoTokenizer's). Anything
else (a chat template to render, settings with which transformers rewrites the tokenizer at load
or its decoded text, or only a slow tokenizer's files) goes through AutoTokenizer as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["TokenizerFile", "has_chat_template", "load_prompt_tokenizer"]

_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_REWRITING_KEYS = ("add_prefix_space", "do_lower_case", "legacy", "from_slow")
_CLEANUP_KEY = "clean_up_tokenization_spaces"
"""tokenizer_config.json settings with which transformers may rebuild parts of tokenizer.json at
load time: such a directory goes through AutoTokenizer, so the ids stay exactly its ids."""


class TokenizerFile:
    """A `tokenizer.json` (plus the BOS/EOS tokens named in `tokenizer_config.json`) as a node uses
    a tokenizer: `__call__`, `decode`, `bos_token_id`, `eos_token_id`, no chat template."""

    chat_template = None

    def __init__(self, path: str | os.PathLike[str], config: dict[str, Any] | None = None):
        """`config`: tokenizer_config.json as already read (read here when None)."""
        from tokenizers import Tokenizer

        d = Path(path)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        self._split: Tokenizer | None = None
        conf = _config(d) if config is None else config
        self.bos_token_id = self._special_id(conf.get("bos_token"))
        self.eos_token_id = self._special_id(conf.get("eos_token"))

    def _special_id(self, token: Any) -> int | None:
        if isinstance(token, dict):  # an AddedToken written out in full
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def all_special_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def __call__(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False
    ) -> dict[str, list[int]]:
        """`split_special_tokens`: a special token's text is tokenized as text (agent input)."""
        tok = self._tok
        if split_special_tokens:
            if self._split is None:  # a copy that reads special tokens' text as text
                from tokenizers import Tokenizer

                self._split = Tokenizer.from_str(tok.to_str())
                self._split.encode_special_tokens = True
            tok = self._split
        return {"input_ids": tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise ValueError("loaded without a chat template (tokenizer.json alone)")


def _config(d: Path) -> dict[str, Any]:
    f = d / "tokenizer_config.json"
    if not f.exists():
        return {}
    conf = json.loads(f.read_text())
    return conf if isinstance(conf, dict) else {}


def has_chat_template(path: str | os.PathLike[str], config: dict[str, Any] | None = None) -> bool:
    d = Path(path)
    conf = _config(d) if config is None else config
    return bool(conf.get("chat_template")) or any((d / f).exists() for f in _TEMPLATE_FILES)


def load_prompt_tokenizer(path: str | os.PathLike[str], chat_template: bool = True) -> Any:
    """`TokenizerFile` when `path` has a tokenizer.json and no template is to be rendered;
    otherwise AutoTokenizer (laminar.models.tiny.load_tokenizer)."""
    d = Path(path)
    conf = _config(d)  # read once: the checks and the BOS token all come from it
    rewrites = any(k in conf for k in _REWRITING_KEYS) or bool(conf.get(_CLEANUP_KEY))
    if (
        (d / "tokenizer.json").exists()
        and not rewrites
        and not (chat_template and has_chat_template(d, conf))
    ):
        return TokenizerFile(d, conf)
    from laminar.models.tiny import load_tokenizer

    return load_tokenizer(d)

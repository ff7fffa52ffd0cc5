"""The buffer's prompt tokenizer: tokenizer.json alone when it can, with AutoTokenizer's ids.

.venv/bin/python -m pytest tests/test_prompt_tokenizer.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from laminar.data.prompts import PromptEncoder
from laminar.models.prompt_tokenizer import TokenizerFile, load_prompt_tokenizer
from laminar.models.tiny import DEFAULT_ALPHABET, char_tokenizer, load_tokenizer

TEXTS = ["", "12 13 14", "count up from 7: 7 8 9", "what is 3+4?\n", "ÿ unknown ☃ chars", "a" * 300]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}assistant:"


def test_tokenizer_json_alone_gives_autotokenizers_ids_and_bos(tmp_path):
    char_tokenizer(DEFAULT_ALPHABET).save_pretrained(tmp_path / "plain")
    fast, auto = load_prompt_tokenizer(tmp_path / "plain"), load_tokenizer(tmp_path / "plain")
    assert isinstance(fast, TokenizerFile) and fast.chat_template is None
    assert fast.bos_token_id == auto.bos_token_id is not None
    for text in TEXTS:
        assert fast(text, add_special_tokens=False)["input_ids"] == list(
            auto(text, add_special_tokens=False)["input_ids"]
        ), text
    for prompt in [*TEXTS[1:], [{"role": "user", "content": "3+4?"}]]:
        a, ta = PromptEncoder(fast).encode(prompt)
        b, tb = PromptEncoder(auto).encode(prompt)
        np.testing.assert_array_equal(a, b)
        assert ta == tb


def test_tokenizer_json_alone_decodes_as_autotokenizer(tmp_path):
    """What a rollout needs: completions decoded and the EOS id, both as AutoTokenizer gives
    them."""
    char_tokenizer(DEFAULT_ALPHABET).save_pretrained(tmp_path / "plain")
    fast, auto = load_prompt_tokenizer(tmp_path / "plain"), load_tokenizer(tmp_path / "plain")
    assert fast.eos_token_id == auto.eos_token_id is not None
    for text in TEXTS:
        ids = [
            auto.bos_token_id,
            *auto(text, add_special_tokens=False)["input_ids"],
            auto.eos_token_id,
        ]
        for skip in (True, False):
            assert fast.decode(np.array(ids), skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
    conf = json.loads((tmp_path / "plain/tokenizer_config.json").read_text())
    (tmp_path / "plain/tokenizer_config.json").write_text(
        json.dumps({**conf, "clean_up_tokenization_spaces": True})
    )  # transformers rewrites the decoded text: its tokenizer, then
    assert not isinstance(load_prompt_tokenizer(tmp_path / "plain"), TokenizerFile)


def test_a_template_or_a_rewriting_setting_goes_through_autotokenizer(tmp_path):
    tok = char_tokenizer(DEFAULT_ALPHABET)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "chat")
    chat = load_prompt_tokenizer(tmp_path / "chat")
    assert not isinstance(chat, TokenizerFile) and chat.chat_template
    ids, _ = PromptEncoder(chat).encode("2+2?")
    assert chat.decode(ids) == "user:2+2?\nassistant:"
    # the run turned templates off: nothing to render, so tokenizer.json is enough
    assert isinstance(load_prompt_tokenizer(tmp_path / "chat", chat_template=False), TokenizerFile)
    char_tokenizer(DEFAULT_ALPHABET).save_pretrained(tmp_path / "prefix")
    conf = json.loads((tmp_path / "prefix/tokenizer_config.json").read_text())
    (tmp_path / "prefix/tokenizer_config.json").write_text(
        json.dumps({**conf, "add_prefix_space": True})
    )
    assert not isinstance(load_prompt_tokenizer(tmp_path / "prefix"), TokenizerFile)


def test_the_buffer_loads_its_prompt_tokenizer_without_torch(tmp_path):
    char_tokenizer(DEFAULT_ALPHABET).save_pretrained(tmp_path / "plain")
    code = (
        "import sys\n"
        "from laminar.buffer.node import BufferNode\n"
        "from laminar.models.prompt_tokenizer import load_prompt_tokenizer\n"
        f"tok = load_prompt_tokenizer({str(tmp_path / 'plain')!r})\n"
        "print(type(tok).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TokenizerFile", "False", "False"]

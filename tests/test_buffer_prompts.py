"""Prompt pool: jsonl + parquet, string + chat prompts, stable uids, epochs, seeded shuffle, cursor,
bad rows.

.venv/bin/python -m pytest tests/test_buffer_prompts.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laminar.buffer.prompts import PromptPool
from laminar.buffer.records import PoolCursor
from laminar.data.prompts import ByteTokenizer, PromptEncoder, derive_uid, load_prompts

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_string_and_chat(tmp_path):
    write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"prompt": "1+1?", "answer": "2", "level": 3},
            {"prompt": CHAT, "ground_truth": 4, "uid": "chat-1"},
            {"prompt": "3+3?", "answer": "6", "uid": 17},
        ],
    )
    pq.write_table(
        pa.table(
            {
                "prompt": ["1+1?", "5+5?"],
                "answer": ["2", "10"],
                "source": ["x", "y"],
            }
        ),
        tmp_path / "b.parquet",
    )
    pq.write_table(pa.table({"prompt": [CHAT], "ground_truth": ["4"]}), tmp_path / "c.parquet")

    rows, report = load_prompts(tmp_path)  # a directory: every jsonl/parquet in name order
    assert report.bad == 0 and report.rows == 6 and len(report.files) == 3
    a0, a1, a2, b0, b1, c0 = rows
    assert (
        a0.prompt == "1+1?"
        and a0.row == {"answer": "2", "level": 3}
        and a0.where.endswith("a.jsonl:1")
    )
    assert a1.uid == "chat-1" and a1.prompt == CHAT and a1.row == {"ground_truth": 4, "answer": 4}
    assert a2.uid == "17"
    assert b0.row == {"answer": "2", "source": "x"} and b0.where.endswith("b.parquet:1")
    assert c0.prompt == CHAT and c0.row["answer"] == "4"
    # derived uids depend on the content only: same prompt, same uid, in any file or position
    assert a0.uid == b0.uid == derive_uid("1+1?") and a0.uid.startswith("p-")
    assert c0.uid == derive_uid(CHAT) != derive_uid("2+2?")
    assert b1.uid != b0.uid
    assert report.duplicate_uids == 1  # "1+1?" appears twice (allowed, counted)


def test_bad_rows_are_reported_with_file_and_line_and_skipped(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "ok 1", "answer": "1"},
            "{not json",
            {"answer": "no prompt"},
            {"prompt": 42},
            {"prompt": [{"role": "user"}]},
            '["a", "list"]',
            {"prompt": "ok 2", "uid": {"nested": 1}},
            "",
            {"prompt": "   "},
            {"prompt": "ok 3"},
            '{"prompt": "huge", "n": 123456789012345678901234567890}',
        ],
    )
    rows, report = load_prompts(path)
    assert [r.prompt for r in rows] == ["ok 1", "ok 3"]
    assert report.bad == 8
    by_line = {e.split(": ", 1)[0].rsplit(":", 1)[1]: e for e in report.errors}
    assert set(by_line) == {"2", "3", "4", "5", "6", "7", "9", "11"}  # line 8 is blank: not a row
    assert "invalid JSON" in by_line["2"] and "missing 'prompt'" in by_line["3"]
    assert "string or a non-empty list" in by_line["4"] and "message 0" in by_line["5"]
    assert (
        "must be an object" in by_line["6"] and "'uid'" in by_line["7"] and "empty" in by_line["9"]
    )
    assert all(e.startswith(str(path) + ":") for e in report.errors)


def test_missing_or_unreadable_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet file"):
        load_prompts(tmp_path / "junk.parquet")


def _pool(rows, **kw):
    return PromptPool(rows, PromptEncoder(None, max_tokens=64), **kw)


def _uids(items):
    return [it.uid for it in items]


def test_epochs_and_seeded_shuffle_are_deterministic(tmp_path):
    rows, _ = load_prompts(
        write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    )
    a, b = _pool(rows, seed=7, epochs=2), _pool(rows, seed=7, epochs=2)
    ea, _ = a.next_items(10, n=4)
    assert _uids(ea) == _uids(b.next_items(10, n=4)[0])
    assert sorted(_uids(ea)) == sorted(r.uid for r in rows)  # an epoch visits every row once
    assert _uids(ea) != [r.uid for r in rows]  # shuffled
    e2, reason = a.next_items(10, n=4)
    assert reason == "" and sorted(_uids(e2)) == sorted(_uids(ea)) and _uids(e2) != _uids(ea)
    assert [it.group_id for it in ea[:2]] == [f"{ea[0].uid}@0#0", f"{ea[1].uid}@0#1"]
    assert e2[0].group_id == f"{e2[0].uid}@1#10" and all(it.n == 4 for it in ea + e2)
    assert len({it.group_id for it in ea + e2}) == 20
    rest, reason = a.next_items(3, n=4)
    assert rest == [] and reason == "epochs_done" and a.exhausted
    c = _pool(rows, seed=8)
    assert _uids(c.next_items(10, n=4)[0]) != _uids(ea)
    d = _pool(rows, shuffle=False)
    assert _uids(d.next_items(10, n=4)[0]) == [r.uid for r in rows]


def test_cursor_survives_restart(tmp_path):
    rows, _ = load_prompts(
        write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(6)])
    )
    ref = _pool(rows, seed=3)
    expected = [it.group_id for it in ref.next_items(15, n=2)[0]]
    first = _pool(rows, seed=3)
    got = [it.group_id for it in first.next_items(8, n=2)[0]]
    cursor = msgspec.msgpack.decode(msgspec.msgpack.encode(first.cursor()), type=PoolCursor)
    again = _pool(rows, seed=3)
    assert again.restore(cursor) == ""
    got += [it.group_id for it in again.next_items(7, n=2)[0]]
    assert got == expected
    assert "rows" in _pool(rows[:5]).restore(cursor)  # a changed dataset is reported


def test_too_long_rows_are_reported_once_and_skipped(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "x" * 100}, {"prompt": "short"}, {"prompt": "y" * 99}]
    )
    rows, _ = load_prompts(path)
    bad = []
    pool = PromptPool(
        rows,
        PromptEncoder(None, max_tokens=10),
        shuffle=False,
        on_bad=lambda w, why: bad.append((w, why)),
    )
    items, _ = pool.next_items(3, n=1)
    assert [it.prompt for it in items] == ["short"] * 3  # three epochs' worth of the one good row
    assert [w for w, _ in bad] == [
        f"{path}:1",
        f"{path}:3",
    ] and "> data.max_prompt_tokens=10" in bad[0][1]
    all_bad = PromptPool(rows[:1], PromptEncoder(None, max_tokens=10))
    assert all_bad.next_items(2, n=1) == ([], "empty")


def test_byte_fallback_and_chat_rendering():
    enc = PromptEncoder(None, max_tokens=100)
    ids, text = enc.encode("hé")
    assert ids.dtype == np.int32 and ids.tolist() == list("hé".encode()) and text == "hé"
    ids, text = enc.encode(CHAT)
    assert bytes(ids.tolist()).decode() == "system: be brief\nuser: 2+2?" and text == "2+2?"
    assert ByteTokenizer.bos_token_id is None


def test_tokenizer_chat_template_and_bos(tmp_path):
    from laminar.models.tiny import char_tokenizer, load_tokenizer

    plain = char_tokenizer("abcdefghijklmnopqrstuvwxyz+?:2 \n")
    plain.save_pretrained(tmp_path / "plain")
    plain.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    plain.save_pretrained(tmp_path / "chat")
    tok = load_tokenizer(tmp_path / "plain")
    ids, _ = PromptEncoder(tok).encode("2+2?")
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "2+2?"  # raw text, BOS prepended
    ctok = load_tokenizer(tmp_path / "chat")
    ids, text = PromptEncoder(ctok).encode(CHAT)
    assert ctok.decode(ids) == "system:be brief\nuser:2+2?\nassistant:" and text == "2+2?"
    ids, _ = PromptEncoder(ctok).encode("2+2?")  # a string prompt becomes one user message
    assert ctok.decode(ids) == "user:2+2?\nassistant:"
    ids, _ = PromptEncoder(ctok, chat_template=False).encode("2+2?")  # data.chat_template: false
    assert ids[0] == ctok.bos_token_id

"""Prompt datasets: files of rows -> PromptRows -> prompt token ids. Shared by the buffer's
prompt pool (laminar/buffer/prompts.py) and the trainer's validation
(laminar/trainer/evaluation.py).

    rows, report = load_prompts("data/train.jsonl")          # jsonl / parquet / a directory of them
    encoder = PromptEncoder(tokenizer, chat_template=True, max_tokens=512)
    ids, reward_text = encoder.encode(rows[0].prompt)       # raises BadRow when it cannot be served

Row format (one JSON object per line, or one parquet row):
  * `prompt`: a string, or chat messages `[{"role": ..., "content": ...}, ...]`;
  * `answer` or `ground_truth`: the reference (any JSON value; optional);
  * `uid`: optional stable id; when missing it is derived from a hash of the prompt
    content (and its images' digests), so the same prompt has the same uid in every file,
    order and run;
  * images (vision-language models, docs/vision.md): chat messages with image parts, an
    `images` column (TRL's and verl's shapes), parsed by laminar/vision/rows.py; each image is
    read, checked against data.max_image_bytes / data.max_image_pixels and digested at load.
  * any other column is passed through to the reward in PromptItem.row, together
    with `answer` (and `ground_truth` under its own name when that column was used).

A bad row (invalid JSON, not an object, missing or mistyped prompt, too many
tokens, a bad image) is reported once with its file and line, counted, and skipped.

Tokenization: with a chat template (and data.chat_template true) the prompt is
rendered with add_generation_prompt and tokenized without extra special tokens;
otherwise the raw text is tokenized and the BOS token prepended when the tokenizer
has one (chat messages without a template render as "role: content" lines). No
model path means byte-level ids (sim engines do not need real tokens).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from laminar.vision.images import BadImage, ImageData, ImageLimits
from laminar.vision.rows import has_images, image_messages

__all__ = [
    "BadRow",
    "ByteTokenizer",
    "LoadReport",
    "PromptEncoder",
    "PromptRow",
    "derive_uid",
    "load_prompts",
]

SUFFIXES = (".jsonl", ".json", ".parquet")


class BadRow(ValueError):
    """A dataset row that cannot be served; the message says why."""


@dataclass
class PromptRow:
    uid: str
    prompt: str | list[dict[str, Any]]
    """A string, or chat messages (content a string, or text and image parts)."""
    row: dict[str, Any]
    where: str
    """file:line of the row (reported with every problem)."""
    images: list[ImageData] = field(default_factory=list)
    """The prompt's images, in the order of its image parts (checked and digested)."""


@dataclass
class LoadReport:
    files: list[str] = field(default_factory=list)
    rows: int = 0
    bad: int = 0
    derived_uids: int = 0
    duplicate_uids: int = 0
    bad_images: int = 0
    """Rows skipped for an image (unreadable, too large, placeholders not matching images)."""
    images: int = 0
    errors: list[str] = field(default_factory=list)
    """The first problems, as "file:line: what"."""

    def add_error(self, text: str, keep: int = 100) -> None:
        self.bad += 1
        if len(self.errors) < keep:
            self.errors.append(text)


def derive_uid(prompt: str | list[dict[str, Any]], image_digests: Sequence[str] = ()) -> str:
    """Stable uid from the prompt content (not its position), e.g. "p-3f2a9c0d1e4b5a67"; a
    multimodal prompt's image digests are part of its content."""
    canon = (
        prompt
        if isinstance(prompt, str)
        else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    )
    if image_digests:
        canon += "\n" + "\n".join(image_digests)
    return "p-" + hashlib.sha1(canon.encode("utf-8")).hexdigest()[:16]


def _plain(value: Any) -> Any:
    """Column values must travel as msgpack: anything exotic (dates, decimals) becomes a string."""
    if value is None or isinstance(value, bool | int | str | bytes):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def _check_prompt(prompt: Any) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("'prompt' is empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise BadRow(f"'prompt' message {i} must be {{'role': str, 'content': str}}")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise BadRow(
        "'prompt' must be a string or a non-empty list of chat messages, "
        f"got {type(prompt).__name__}"
    )


class BadImageRow(BadRow):
    """A row skipped for one of its images (counted apart: LoadReport.bad_images)."""


def parse_row(
    obj: Any, where: str, base_dir: Path | None = None, limits: ImageLimits | None = None
) -> PromptRow:
    """Validate one decoded row (a dict) into a PromptRow, or raise BadRow. `base_dir`: where
    relative image paths start (the data file's folder)."""
    if not isinstance(obj, dict):
        raise BadRow(f"row must be an object, got {type(obj).__name__}")
    if "prompt" not in obj or obj["prompt"] is None:
        raise BadRow("missing 'prompt'")
    images: list[ImageData] = []
    prompt: str | list[dict[str, Any]]
    if has_images(obj["prompt"], obj.get("images")):
        try:
            prompt, images = image_messages(
                obj["prompt"], obj.get("images"), base_dir, limits or ImageLimits()
            )
        except BadImage as exc:
            raise BadImageRow(f"bad image: {exc}") from None
    else:
        prompt = _check_prompt(obj["prompt"])
    uid = obj.get("uid")
    if uid is None or uid == "":
        uid = derive_uid(prompt, [i.digest for i in images])
    elif isinstance(uid, bool) or not isinstance(uid, str | int):
        raise BadRow(f"'uid' must be a string or an integer, got {type(uid).__name__}")
    # the images travel as PromptItem.images, once per group, never inside the row
    row = {str(k): _plain(v) for k, v in obj.items() if k not in ("prompt", "uid", "images")}
    if "answer" not in row and "ground_truth" in row:
        row["answer"] = row["ground_truth"]
    try:  # the row travels to the rollouts and into the journal as msgpack
        msgpack.packb(row, use_bin_type=True)
    except (TypeError, OverflowError, ValueError) as exc:
        raise BadRow(f"a column value cannot be sent ({exc})") from None
    return PromptRow(uid=str(uid), prompt=prompt, row=row, where=where, images=images)


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
        if not found:
            raise FileNotFoundError(f"no {'/'.join(SUFFIXES)} files in {path}")
        return found
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset {path} does not exist")
    return [path]


def _add_bad(report: LoadReport, where: str, exc: BadRow) -> None:
    if isinstance(exc, BadImageRow):
        report.bad_images += 1
    report.add_error(f"{where}: {exc}")


def _read_jsonl(path: Path, rows: list[PromptRow], report: LoadReport, limits: ImageLimits) -> None:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
                rows.append(parse_row(obj, where, path.parent, limits))
            except json.JSONDecodeError as exc:
                report.add_error(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})")
            except BadRow as exc:
                _add_bad(report, where, exc)


def _read_parquet(
    path: Path, rows: list[PromptRow], report: LoadReport, limits: ImageLimits
) -> None:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    lineno = 0
    for batch in pf.iter_batches(batch_size=4096):
        for obj in batch.to_pylist():
            lineno += 1
            where = f"{path}:{lineno}"
            try:
                rows.append(parse_row(obj, where, path.parent, limits))
            except BadRow as exc:
                _add_bad(report, where, exc)


def load_prompts(
    path: str | Path, limits: ImageLimits | None = None
) -> tuple[list[PromptRow], LoadReport]:
    """Read every row of a jsonl/parquet file (or a directory of them); bad rows are reported.
    `limits`: the bounds on a prompt's images (default ImageLimits())."""
    report = LoadReport()
    rows: list[PromptRow] = []
    lim = limits or ImageLimits()
    for f in _files(Path(path)):
        report.files.append(str(f))
        if f.suffix == ".parquet":
            _read_parquet(f, rows, report, lim)
        else:
            _read_jsonl(f, rows, report, lim)
    seen: set[str] = set()
    for r in rows:
        if r.uid in seen:
            report.duplicate_uids += 1
        seen.add(r.uid)
    report.rows = len(rows)
    report.images = sum(len(r.images) for r in rows)
    return rows, report


class ByteTokenizer:
    """Fallback when no model path is set: UTF-8 bytes as ids, no BOS, no chat template."""

    bos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def _render_plain(messages: list[dict[str, str]]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class PromptEncoder:
    """Prompt (string or chat) -> token ids, with the tokenizer's chat template when it has one.

    `tokenizer`: a Hugging Face tokenizer (or None: ByteTokenizer), anything with `__call__`,
    `apply_chat_template`, `chat_template` and `bos_token_id`.
    """

    def __init__(self, tokenizer: Any, chat_template: bool = True, max_tokens: int = 512):
        self.tok: Any = tokenizer if tokenizer is not None else ByteTokenizer()
        self.use_template = bool(chat_template and self.tok.chat_template)
        self.max_tokens = max_tokens

    def encode(
        self, prompt: str | list[dict[str, Any]], images: list[ImageData] | tuple = ()
    ) -> tuple[np.ndarray, str]:
        """(prompt_ids, text for the reward); raises BadRow when it cannot be served."""
        if (
            images
            or not isinstance(prompt, str)
            and any(not isinstance(m.get("content"), str) for m in prompt)
        ):
            raise BadRow(
                "the prompt has image parts but model.path is not a vision-language model "
                "(its config.json has no vision_config)"
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        reward_text = (
            prompt
            if isinstance(prompt, str)
            else next(
                (m["content"] for m in reversed(messages) if m["role"] == "user"),
                messages[-1]["content"],
            )
        )
        try:
            if self.use_template:
                text = self.tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
                ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            else:
                text = prompt if isinstance(prompt, str) else _render_plain(messages)
                ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
                if self.tok.bos_token_id is not None:
                    ids.insert(0, self.tok.bos_token_id)
        except Exception as exc:  # a template or tokenizer failure is a property of this row
            raise BadRow(f"tokenization failed: {type(exc).__name__}: {exc}") from None
        if not ids:
            raise BadRow("prompt tokenizes to nothing")
        if len(ids) > self.max_tokens:
            raise BadRow(f"prompt has {len(ids)} tokens > data.max_prompt_tokens={self.max_tokens}")
        return np.asarray(ids, dtype=np.int32), reward_text

"""Chat messages <-> the exact tokens of an episode, for the OpenAI-compatible endpoint.

    r = ChatRenderer(tokenizer)                       # HF tokenizer, TokenizerFile, or None
    ids = r.first_ids(messages, tools)                # a whole conversation + generation prompt
    ids = r.delta_ids(new_messages, after_eot=True)   # what follows the model's last turn
    msg = r.assistant_message(text, tools_on, ids)    # the model's turn as an API message
    key = canonical(message)                          # what "the same message" means

Token in, token out. The endpoint renders a conversation once, at its first call; after that
it tokenizes only the messages that follow the model's last turn (`delta_ids`), and the model's
own tokens are never re-tokenized. Whether a call extends the episode is decided on messages,
not on text: its messages must start with the ones the episode already holds, the assistant
turns as the endpoint returned them (`canonical`: role, content, tool calls by name and
parsed arguments; ids and null fields ignored, since clients echo them back differently).

With a chat template (a tokenizer whose `chat_template` is set) the first call is
`apply_chat_template(messages, tools=..., add_generation_prompt=True)`, so tools and
tool_choice are rendered the way the model was trained to read them; a delta is what the
template writes after an assistant turn's content, found by the marker diff of
laminar/envs/template.py (TurnTemplate: its end-of-turn handling is reused). Without a chat
template (the tiny char-level tokenizer) the format is the plain one of laminar/envs/template.py,
so an OpenAI-client agent sees exactly the token sequences the in-process ToolEnv makes:

    first call   BOS + system content + "\\n" + user content (later user: "\\n" + text + "\\n")
    tool         "\\n<tool_response>" + content + "</tool_response>\\n" (consecutive ones joined)
    assistant    its content and <tool_call>{...}</tool_call> blocks, verbatim
    tools        not rendered (no place for them in the plain format); the model is trained on
                 its tool. Its turn ends at "</tool_call>" (`TOOL_STOP`), as ToolEnv's does.

Images (vision-language models): a later call's messages may hold `image_url` parts (data: URIs;
nothing is fetched); the chat template renders each as its image part (the plain format as
`image_placeholder`), one placeholder token per image, which the agent driver expands as the
model's processor does and sends to the buffer once (laminar/vision/turns.py). `canonical` keeps
where each image sits and a digest of its URL, so a repeated history still matches. A first
call's images are refused: the episode's prompt is the sample's.

The model's text becomes `tool_calls` by laminar/envs/toolcall.py (<tool_call>{"name": ...,
"arguments": {...}}</tool_call> blocks, what Hermes/Qwen-style templates teach); the
content is the text before the first block.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from laminar.envs.base import call_id
from laminar.envs.template import _MARK, TemplateError, TurnTemplate
from laminar.envs.toolcall import CALL_OPEN, parse_tool_calls

TOOL_STOP = "</tool_call>"
"""Ends a model turn in the plain format when the call has tools (the model writes no EOS after
a call: the tool's answer follows)."""


class BadMessages(ValueError):
    """Messages the endpoint cannot render (the text says why); an HTTP 400."""


def _parts(m: dict[str, Any]) -> list[tuple[str, str]]:
    """A message's content as ("text", text) and ("image", url) parts, in order."""
    c = m.get("content")
    if c is None:
        return []
    if isinstance(c, str):
        return [("text", c)]
    if not isinstance(c, list):
        raise BadMessages(f"message content must be a string or a list of parts, not {type(c)}")
    out = []
    for part in c:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(("text", str(part.get("text", ""))))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise BadMessages("an image_url part needs image_url.url (a data: URI)")
            out.append(("image", url))
        else:
            raise BadMessages("only text and image_url content parts are supported")
    return out


def _content(m: dict[str, Any], image_text: str | None = None) -> str:
    """The message's text; image parts written as `image_text` (None: they are refused)."""
    out = []
    for kind, value in _parts(m):
        if kind == "text":
            out.append(value)
        elif image_text is None:
            raise BadMessages(
                "image parts need a vision-language model.path, in a later call of the episode "
                "(docs/vision.md)"
            )
        else:
            out.append(image_text)
    return "".join(out)


def image_urls(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The image parts' URLs of these messages, in order (what their placeholders stand for)."""
    return [v for m in messages for kind, v in _parts(m) if kind == "image"]


def _calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for tc in m.get("tool_calls") or []:
        if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
            raise BadMessages("each tool_calls item needs a `function` object")
        fn = tc["function"]
        args: Any = fn.get("arguments", "")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                pass  # compared as the string it is
        out.append((str(fn.get("name", "")), args))
    return out


def canonical_tools(tools: Any) -> str:
    """A call's tool list as a comparable string ("" without tools): a later call that changes
    its tools starts a new run of the episode."""
    if tools is None:
        return ""
    return json.dumps(tools, sort_keys=True, default=str)


def canonical(m: Any) -> str:
    """One message as a comparable string (role, content, tool calls by name and arguments)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadMessages("each message must be an object with a string `role`")
    role = m["role"]
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise BadMessages(f"unknown message role {role!r}")
    parts = _parts(m)
    body: list[Any] = [role, "".join(v for k, v in parts if k == "text")]
    body.append(_calls(m) if role == "assistant" else [])
    if any(k == "image" for k, _ in parts):  # where each image sits, and which one it is
        body.append([[k, v if k == "text" else _url_key(v)] for k, v in parts])
    return json.dumps(body, sort_keys=True, default=str)


def _url_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


_GUARD_OPEN, _GUARD_CLOSE = "\ue000", "\ue001"
"""Private-use characters around a special token's index: where the agent typed its text."""
_GUARDED = re.compile(f"{_GUARD_OPEN}(\\d+){_GUARD_CLOSE}")


def _plain_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template gets it (content as a string, or as text and image parts
    when it shows images; tool arguments parsed)."""
    parts = _parts(m)
    content: Any = "".join(v for k, v in parts if k == "text")
    if any(k == "image" for k, _ in parts):
        content = [
            {"type": "image"} if k == "image" else {"type": "text", "text": v} for k, v in parts
        ]
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if out["role"] == "developer":
        out["role"] = "system"
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in _calls(m)
        ]
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    if m.get("name"):
        out["name"] = str(m["name"])
    return out


class ChatRenderer:
    def __init__(self, tokenizer: Any, image_placeholder: str = ""):
        """`image_placeholder`: one image in the plain format (vision-language models; empty:
        image parts are refused)."""
        self.tok = tokenizer
        self.turns = TurnTemplate(tokenizer, image_placeholder=image_placeholder)
        """The end-of-turn token and the plain format, as the in-process environments use them."""
        self.chat = self.turns.chat
        bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
        self.bos: list[int] = [int(bos)] if bos is not None else []
        specials = getattr(tokenizer, "all_special_tokens", None) if self.chat else None
        self.specials: tuple[str, ...] = tuple(t for t in specials or () if t)
        """The special tokens' texts (in the agent's text inside a chat template they stay text)."""
        self._by_length = sorted(range(len(self.specials)), key=lambda k: -len(self.specials[k]))
        """Longest first: a special token's text that holds another's is guarded whole."""

    def encode(self, text: str) -> list[int]:
        """Text an agent typed (with what the plain format wraps around it): a special token's
        text in it ("<eos>") stays text, never the special id (split_special_tokens)."""
        if self.tok is None:
            return list(text.encode("utf-8"))
        enc = self.tok(text, add_special_tokens=False, split_special_tokens=True)
        return [int(i) for i in enc["input_ids"]]

    def _template_encode(self, text: str) -> list[int]:
        """A chat template's text: its own special tokens are tokens; a special token's text the
        agent typed was guarded (`_guard`) and is tokenized as text (split_special_tokens)."""
        if _GUARD_OPEN not in text:
            return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]
        ids: list[int] = []
        for k, piece in enumerate(_GUARDED.split(text)):
            if k % 2 and int(piece) < len(self.specials):  # typed special text: split
                ids += self.encode(self.specials[int(piece)])
            elif k % 2:  # the agent typed the mark itself: it is text
                ids += self.encode(f"{_GUARD_OPEN}{piece}{_GUARD_CLOSE}")
            elif piece:
                ids += [int(i) for i in self.tok(piece, add_special_tokens=False)["input_ids"]]
        return ids

    def _guard(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template gets them, with a special token's text in the agent's
        messages (the model's own turns, echoed back, are not the agent's text) replaced by a
        guard mark, so `_template_encode` tokenizes it as text: a typed "<eos>" stays text."""
        out = []
        for m in messages:
            pm = _plain_message(m)
            if m.get("role") != "assistant":
                if isinstance(pm["content"], list):
                    for part in pm["content"]:
                        if part["type"] == "text":
                            part["text"] = self._guard_text(part["text"])
                else:
                    pm["content"] = self._guard_text(pm["content"])
            out.append(pm)
        return out

    def _guard_text(self, text: str) -> str:
        for k in self._by_length:
            if self.specials[k] in text:
                text = text.replace(self.specials[k], f"{_GUARD_OPEN}{k}{_GUARD_CLOSE}")
        return text

    def _image_text(self) -> str | None:
        return self.turns.image_placeholder or None

    def decode(self, ids: Sequence[int]) -> str:
        return self.turns.decode(ids)

    def token_text(self, i: int) -> str:
        """One token as text, special tokens included (what `logprobs` lists)."""
        if self.tok is None:
            return bytes([i]).decode("utf-8", errors="replace") if 0 <= i < 256 else ""
        return str(self.tok.decode([int(i)], skip_special_tokens=False))

    def stop_strings(self, tools_on: bool) -> tuple[str, ...]:
        return (TOOL_STOP,) if tools_on and not self.chat else ()

    # ---- into tokens ---------------------------------------------------------------------
    def first_ids(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        """A conversation's tokens up to the model's turn (the episode's prompt)."""
        if not messages:
            raise BadMessages("`messages` is empty")
        if image_urls(messages):
            raise BadMessages(
                "image parts are taken in a later call of the episode (after the model's first "
                "answer), not in its first one: the prompt is the sample's (docs/vision.md)"
            )
        if self.chat:
            msgs = self._guard(messages)
            kw: dict[str, Any] = {"tools": tools} if tools else {}
            try:
                text = self.tok.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=True, **kw
                )
            except Exception as exc:  # jinja raises what the template's author chose
                raise BadMessages(f"the chat template refused the messages: {exc}") from None
            return self._template_encode(str(text))
        parts, first_user = [], True
        for m in messages:
            role, text = m["role"], _content(m)
            if role in ("system", "developer"):
                parts.append(text + "\n")
            elif role == "user":
                parts.append(text if first_user else "\n" + text + "\n")
                first_user = False
            elif role == "assistant":
                parts.append(text + "".join(_call_block(n, a) for n, a in _calls(m)))
            else:
                parts.append(self.turns.observation_text(text, "tool"))
        return self.bos + self.encode("".join(parts))

    def delta_ids(self, new: list[dict[str, Any]], after_eot: bool) -> list[int]:
        """The tokens of messages that follow the model's last turn, up to its next turn.
        `after_eot`: that turn ended on the end-of-turn token it sampled (not repeated)."""
        if not new:
            raise BadMessages("no new message after the model's last turn")
        if not self.chat:
            text, i = "", 0
            while i < len(new):  # a run of one role: one observation, as ToolEnv renders it
                role = "tool" if new[i]["role"] == "tool" else "user"
                j = i
                while j < len(new) and ("tool" if new[j]["role"] == "tool" else "user") == role:
                    j += 1
                texts = [_content(m, self._image_text()) for m in new[i:j]]
                text += self.turns.observation_text(texts, role)
                i = j
            return self.encode(text)
        if image_urls(new) and not self.turns.image_placeholder:
            raise BadMessages("image parts need a vision-language model.path (docs/vision.md)")
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        try:
            full = str(
                self.tok.apply_chat_template(
                    base + self._guard(new),
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
        except Exception as exc:
            raise BadMessages(f"the chat template refused the messages: {exc}") from None
        cut = full.find(_MARK)
        if cut < 0:
            raise TemplateError("the chat template drops the assistant's content")
        obs = full[cut + len(_MARK) :]
        if after_eot and self.turns.eot_ids:
            eot = self.tok.decode(self.turns.eot_ids, skip_special_tokens=False)
            obs = obs[len(eot) :] if obs.startswith(eot) else obs
        return self._template_encode(obs)

    # ---- out of tokens -------------------------------------------------------------------
    def assistant_message(
        self, text: str, tools_on: bool, uid: str, turn: int
    ) -> tuple[dict[str, Any], bool]:
        """The model's turn as an API message, and whether it called tools. Tool call ids are
        deterministic (uid, turn, index, name, arguments): laminar/envs/base.py `call_id`."""
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if not tools_on or CALL_OPEN not in text:
            return msg, False
        calls, _bad = parse_tool_calls(text)
        if not calls:
            return msg, False
        msg["content"] = text[: text.find(CALL_OPEN)] or None
        msg["tool_calls"] = [
            {
                "id": call_id(uid, turn, k, c.name, c.arguments),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for k, c in enumerate(calls)
        ]
        return msg, True


def _call_block(name: str, args: Any) -> str:
    body = json.dumps({"name": name, "arguments": args}, separators=(",", ":"))
    return f"{CALL_OPEN}{body}{TOOL_STOP}"

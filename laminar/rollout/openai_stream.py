"""A streamed call (`stream: true`): its turn's tokens as OpenAI's server-sent chunks.

    openai_api.py ──driver.turn(token, turn, TurnStream)──► task ──► TurnResult
         │  each engine event of the turn: stream.push(ids, logprobs) (agents.py `progressed`)
         ▼
    ChatChunks | TextChunks .tokens(ids, logprobs) ──► chunk dicts ──► `data: {json}\\n\\n`
                            .end(TurnResult)       ──► the rest, tool calls, finish, usage
    then `data: [DONE]`

chat.completion.chunk, as OpenAI sends it: the role first, content deltas as the text grows,
each chunk's tokens' logprobs when asked (`logprobs: true`), the tool calls (index, id, name,
then the arguments) once the turn is whole and parsed as an unstreamed call parses them, a
chunk with the finish_reason, and with `stream_options.include_usage` a last chunk with no
choices and the usage. /v1/completions streams text_completion chunks the same way.

What is recorded and trained is the call's TurnResult, the same as unstreamed: the streamed
tokens are a prefix of its ids (pushed from the same arrays). The text is decoded over a
window of the last tokens (as vLLM's detokenizer does: a quadratic re-decode of the whole turn
per token would hold the event loop on long turns) and held back while it ends in a partial
character, or, when tools are offered, while it could be the start of a tool call's
`<tool_call>` (a tool call's text is never content). At the end the content is the result
message's: what the pieces missed is sent then; a tokenizer whose decode of a prefix is not a
prefix of the whole (no common one) would leave the streamed text different from the
message's, counted as `agent_stream_text_mismatch`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from laminar.envs.toolcall import CALL_OPEN
from laminar.rollout.agent_turns import TurnResult
from laminar.rollout.openai_shapes import TokenText, finish_reason, usage

Decode = Callable[[Sequence[int]], str]
"""Token ids as the turn's text, special tokens skipped (ChatRenderer.decode)."""

DONE = b"data: [DONE]\n\n"


def event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON body."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class TurnText:
    """The text of a turn's growing token list, in pieces that only ever extend it."""

    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        """The text of `ids[:read]`."""
        self._prefix = 0
        """Where the decode window starts: the tokens before `read` it decodes again as context
        (a token's text can depend on the one before: a leading space, a split character)."""
        self._read = 0

    def add(self, ids: Sequence[int]) -> None:
        self.ids.extend(int(i) for i in ids)
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)


class _Chunks:
    """What both chunk kinds share: ids, the text so far, what was sent of it, the usage."""

    obj = ""
    id_prefix = ""

    def __init__(self, model: str, decode: Decode, token_text: TokenText):
        self.model, self.token_text = model, token_text
        self.turn_id = ""
        """<sample uid>-<attempt>-<turn> (TurnResult.turn_id), once the turn is known."""
        self.created = int(time.time())
        self.text = TurnText(decode)
        self.sent = ""
        """The text streamed so far."""
        self.seen = 0
        """Tokens streamed so far."""
        self.mismatch = False
        """The result's text does not extend what was streamed (never with a common tokenizer)."""

    def _body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id_prefix + self.turn_id,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _rest(self, final: str) -> str:
        """What the final text adds to what was streamed."""
        if not final.startswith(self.sent):
            self.mismatch = True
            return ""
        return final[len(self.sent) :]

    def usage_chunk(self, turn: TurnResult) -> dict[str, Any]:
        return self._body([], usage=usage(turn))


class ChatChunks(_Chunks):
    """chat.completion.chunk bodies of one streamed chat call."""

    obj = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(
        self,
        model: str,
        decode: Decode,
        token_text: TokenText,
        *,
        logprobs: bool,
        tools_on: bool,
    ):
        super().__init__(model, decode, token_text)
        self.logprobs, self.tools_on = logprobs, tools_on

    def _choice(
        self, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]

    def start(self) -> list[dict[str, Any]]:
        return [self._body(self._choice({"role": "assistant", "content": ""}))]

    def tokens(self, ids: np.ndarray, lps: np.ndarray) -> list[dict[str, Any]]:
        """The chunk of newly sampled tokens (none when they add no text and no logprobs are
        asked)."""
        if not len(ids):
            return []
        self.seen += len(ids)
        self.text.add(ids.tolist())
        t = self.text.text
        end = len(t)
        if self.tools_on:  # a call's text is not content: hold what may begin one
            at = t.find(CALL_OPEN, len(self.sent))
            end = at if at >= 0 else end - _held(t, CALL_OPEN)
        delta = t[len(self.sent) : end] if end > len(self.sent) else ""
        self.sent += delta
        lp = None
        if self.logprobs:
            pairs = zip(ids.tolist(), lps.tolist(), strict=True)
            lp = {"content": [self._logprob(i, x) for i, x in pairs]}
        if not delta and lp is None:
            return []
        return [self._body(self._choice({"content": delta} if delta else {}, lp))]

    def _logprob(self, i: int, lp: float) -> dict[str, Any]:
        tok = self.token_text(i)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}

    def end(self, turn: TurnResult, include_usage: bool) -> list[dict[str, Any]]:
        """The turn's last chunks: its tokens not streamed yet, the rest of the content, the
        tool calls, the finish_reason, the usage."""
        out = self.tokens(turn.ids[self.seen :], turn.logprobs[self.seen :])
        msg = turn.message or {}
        rest = self._rest(msg.get("content") or "")
        if rest:
            self.sent += rest
            out.append(self._body(self._choice({"content": rest})))
        for k, call in enumerate(msg.get("tool_calls") or []):
            fn = call["function"]
            head = {"index": k, "id": call["id"], "type": "function"}
            out.append(
                self._body(
                    self._choice({"tool_calls": [{**head, "function": {"name": fn["name"]}}]})
                )
            )
            args = {"index": k, "function": {"arguments": fn["arguments"]}}
            out.append(self._body(self._choice({"tool_calls": [args]})))
        finish = "tool_calls" if turn.tool_called else finish_reason(turn)
        out.append(self._body(self._choice({}, finish=finish)))
        if include_usage:
            out.append(self.usage_chunk(turn))
        return out


class TextChunks(_Chunks):
    """text_completion bodies of one streamed /v1/completions call."""

    obj = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model: str, decode: Decode, token_text: TokenText, *, logprobs: bool):
        super().__init__(model, decode, token_text)
        self.logprobs = logprobs
        self._offset = 0
        """Characters of the token texts listed so far (`text_offset`)."""

    def _choice(self, text: str, logprobs: Any = None, finish: str | None = None) -> list[Any]:
        return [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]

    def start(self) -> list[dict[str, Any]]:
        return []

    def tokens(self, ids: np.ndarray, lps: np.ndarray) -> list[dict[str, Any]]:
        if not len(ids):
            return []
        self.seen += len(ids)
        self.text.add(ids.tolist())
        delta = self.text.text[len(self.sent) :]
        self.sent += delta
        lp = None
        if self.logprobs:
            toks = [self.token_text(int(i)) for i in ids]
            offsets = np.cumsum([self._offset] + [len(t) for t in toks]).tolist()
            self._offset = offsets[-1]
            lp = {
                "tokens": toks,
                "token_logprobs": [float(x) for x in lps],
                "top_logprobs": None,
                "text_offset": offsets[:-1],
            }
        if not delta and lp is None:
            return []
        return [self._body(self._choice(delta, lp))]

    def end(self, turn: TurnResult, include_usage: bool) -> list[dict[str, Any]]:
        out = self.tokens(turn.ids[self.seen :], turn.logprobs[self.seen :])
        rest = self._rest(turn.text)
        self.sent += rest
        out.append(self._body(self._choice(rest, finish=finish_reason(turn))))
        if include_usage:
            out.append(self.usage_chunk(turn))
        return out

"""The turn template: the exact tokens an environment's answer adds to a trajectory.

    tt = TurnTemplate(tokenizer)                     # HF tokenizer, or None (UTF-8 bytes as ids)
    ids = tt.observation_ids(res.observation, res.role, after_eot=tt.ended_with_eot(model_ids))
    text = tt.decode(model_ids)                      # a model turn's text for env.step
    tt.ends_turn(model_ids, env.stop)                # did this model run end its turn?

Token in, token out: the rollout appends `ids` (loss mask 0) after the model's sampled
tokens and resumes generation after them. Nothing already in the trajectory is ever
re-tokenized, so what the trainer sees is exactly what the policy saw.

With a chat template (a HF tokenizer whose `chat_template` is set), the observation is
what the template writes between the model's content and the next assistant content,
found by a diff: render [system?, user, assistant MARK, <role> text...] with
add_generation_prompt=True, cut it after MARK, and tokenize that suffix once with
add_special_tokens=False. The suffix starts with the template's end of the assistant
turn (`turn_end`, e.g. "<|im_end|>\\n" for ChatML) and ends with the header of the next
assistant turn ("<|im_start|>assistant\\n"). The subtlety is the end-of-turn token
(`eot_ids`, the first token of `turn_end` when it is a special token, e.g. <|im_end|>):

  * the model sampled it (EOS / the turn ended on it): it is already in the model's
    tokens with its logprob, so the observation starts right after it
    (`after_eot=True`: "\\n<|im_start|>user..." for ChatML);
  * the turn ended on a stop string (ToolEnv's "</tool_call>") or a length cap: the
    model never wrote the end of its turn, so the observation starts with all of
    `turn_end` (environment tokens, mask 0), exactly as the template would render it.

Either way prompt + model tokens + observation tokens + ... is what the chat template
renders for the whole conversation (tests/test_envs.py checks this "no drift"
property). Only the text after the model's content is taken from the template, so a
template that renders earlier turns differently once a later one follows (Qwen3 drops
<think> blocks from history) changes nothing here: the trajectory stays the token
sequence the policy saw, never a re-render. A template that does not render the
assistant's content verbatim is refused (TemplateError) when the TurnTemplate is made;
one without a tool role (it raises on one) gets the tool results as one user message of
<tool_response> blocks instead (`tool_as_user`).

Without a chat template (the tiny char-level tokenizer, or no tokenizer at all) the
format is plain and fixed, tokenized with add_special_tokens=False (characters the
tokenizer does not know become its <unk>):

    role tool:   "\\n<tool_response>" + text + "</tool_response>\\n"   (one block per message)
    other roles: "\\n" + text + "\\n"

Images (vision-language models, `images=k`): the observation's last message shows k images
before its text, as the chat template renders image parts (`{"type": "image"}`, one placeholder
each), or, in the plain format, `image_placeholder` k times before its text. The caller expands
each placeholder to the processor's run (laminar/vision/turns.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from laminar.envs.toolcall import format_tool_response

_MARK = "LAMINARTURNMARK"
"""Stands in for the model's content when the template is probed (plain ASCII survives any
template)."""


class TemplateError(ValueError):
    """The tokenizer's chat template cannot produce observation tokens without drift."""


class TurnTemplate:
    def __init__(
        self,
        tokenizer: Any,
        *,
        use_chat_template: bool = True,
        system: str | None = None,
        image_placeholder: str = "",
    ):
        """`use_chat_template` false forces the plain format; `system` is the system message
        the prompts are rendered with (only the template's rendering of it matters).
        `tokenizer`: a HF tokenizer, or None (UTF-8 bytes as ids, plain format).
        `image_placeholder`: one image in the plain format (vision-language models)."""
        self.tok: Any = tokenizer
        self.image_placeholder = image_placeholder
        self.chat = bool(use_chat_template and tokenizer is not None and tokenizer.chat_template)
        self._base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self._base += [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        self.turn_end = ""
        """What the template writes after an assistant message's content ("" in the plain
        format)."""
        self.eot_ids: list[int] = []
        """The end-of-turn token the model samples, when `turn_end` starts with one."""
        self.tool_as_user = False
        """The chat template has no tool role: tool results go in one user message of
        <tool_response> blocks (found by probing the template once, here)."""
        if self.chat:
            probe = self._render(self._base, generation_prompt=False)
            cut = probe.rfind(_MARK)
            if cut < 0:
                raise TemplateError(
                    "the chat template does not render the assistant's content "
                    "verbatim; set use_chat_template=False for the plain format"
                )
            self.turn_end = probe[cut + len(_MARK) :]
            first = self._encode(self.turn_end)[:1]
            special = set(self.tok.all_special_ids)
            if first and first[0] in special:
                self.eot_ids = first
            try:
                self.observation_ids("probe", "tool")
            except TemplateError:
                raise
            except Exception:  # jinja raises what the template's author chose
                self.tool_as_user = True
            self.observation_ids("probe", "tool")  # fail now, not mid-episode

    # ---- rendering ----------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        out = self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(out)

    def _encode(self, text: str) -> list[int]:
        if self.tok is None:
            return list(text.encode("utf-8"))
        return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]

    def observation_text(
        self,
        text: str | Sequence[str],
        role: str = "tool",
        after_eot: bool = False,
        images: int = 0,
    ) -> str:
        """The text `observation_ids` tokenizes (a list = several messages of `role`; `images`:
        that many images shown before the last message's text)."""
        texts = [text] if isinstance(text, str) else list(text)
        if images and not texts:
            texts = [""]
        if not self.chat:
            if images:
                if not self.image_placeholder:
                    raise TemplateError("images in an observation need a vision-language model")
                texts[-1] = self.image_placeholder * images + texts[-1]
            if role == "tool":
                return "\n" + format_tool_response(texts) + "\n"
            return "\n" + "\n".join(texts) + "\n"
        messages: list[dict[str, Any]] = [{"role": role, "content": t} for t in texts]
        if role == "tool" and self.tool_as_user:
            messages = [{"role": "user", "content": format_tool_response(texts)}]
        if images:
            last = messages[-1]
            parts: list[dict[str, Any]] = [{"type": "image"}] * images
            last["content"] = [*parts, {"type": "text", "text": last["content"]}]
        full = self._render(self._base + messages, generation_prompt=True)
        cut = full.find(_MARK)
        if cut < 0:
            raise TemplateError(
                f"the chat template drops the assistant's content once a {role!r} message "
                "follows; set use_chat_template=False for the plain format"
            )
        obs = full[cut + len(_MARK) :]
        if after_eot and self.eot_ids:
            eot_text = self.tok.decode(self.eot_ids, skip_special_tokens=False)
            if obs.startswith(eot_text):
                obs = obs[len(eot_text) :]
        return obs

    def observation_ids(
        self,
        text: str | Sequence[str],
        role: str = "tool",
        after_eot: bool = False,
        images: int = 0,
    ) -> list[int]:
        """The exact tokens the environment adds after a model turn, up to and including the
        header of the next assistant turn. `after_eot`: the model's turn ended on the
        end-of-turn token it sampled (see `ended_with_eot`), which is then not repeated.
        `images`: one placeholder per image, not yet expanded."""
        return self._encode(self.observation_text(text, role, after_eot, images))

    # ---- the model's side -----------------------------------------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        """A model turn's text (special tokens skipped), as the environment reads it."""
        if self.tok is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def ended_with_eot(self, ids: Sequence[int]) -> bool:
        """The model's turn ends with the template's end-of-turn token (it sampled it)."""
        n = len(self.eot_ids)
        return n > 0 and len(ids) >= n and [int(i) for i in ids[-n:]] == self.eot_ids

    def ends_turn(self, ids: Sequence[int], stop: Sequence[str] = ()) -> bool:
        """Whether a model run ended its turn: on EOS / the end-of-turn token or a stop string."""
        if not len(ids):
            return False
        eos = None if self.tok is None else self.tok.eos_token_id
        if self.ended_with_eot(ids) or (eos is not None and int(ids[-1]) == eos):
            return True
        if not stop:
            return False
        tail = self.decode(ids[-(max(len(s) for s in stop) + 8) :])
        return any(s and tail.endswith(s) for s in stop)

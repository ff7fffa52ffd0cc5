"""The tool-use task (laminar/tasks/tooluse.py), its warm-up transcripts and the tool demo's
offline episode loop (laminar/tasks/evaluate.py).

    .venv/bin/python -m pytest tests/test_tool_task.py -q
"""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from laminar.config import EnvLimits
from laminar.demo.tooldemo.direct_tools import DirectToolClient
from laminar.demo.tooldemo.results import point, summarize, summary_md
from laminar.engines.base import SamplingParams
from laminar.envs.template import TurnTemplate
from laminar.envs.tool_env import ToolEnv
from laminar.envs.toolcall import parse_tool_calls
from laminar.models.tiny import char_tokenizer
from laminar.models.warmup import _fingerprint, encode_transcript
from laminar.tasks import tooluse as tu
from laminar.tasks.base import Episodes, HeldOut, prompt_ids
from laminar.tasks.evaluate import Outcome, run_episode, summarize_outcomes
from laminar.tools.builtin import calculator

TOOL_SOLUTION = (
    '<tool_call>{"name":"calculator","arguments":{"expression":"47*86"}}</tool_call>'
    "\n<tool_response>4042</tool_response>\n#4042"
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(tu.ALPHABET)


def test_prompts_answers_and_reference_solutions():
    assert tu.parse_prompt("47*86=?") == ("hard", 47, 86)
    assert tu.parse_prompt("47+6=?") == ("easy", 47, 6)
    assert tu.solve("47*86=?") == TOOL_SOLUTION
    assert tu.solve("47+6=?") == "#53"
    assert tu.estimate("47*86=?") == 50 * 90
    for bad in ("40*86=?", "47*80=?", "7*86=?", "47+16=?", "47-6=?", "", "47*86"):
        with pytest.raises(ValueError):
            tu.parse_prompt(bad)
    rows = tu.generate(2000, "train", 0)
    assert {r["kind"] for r in rows} == {"easy", "hard"}
    assert 0.45 < sum(r["kind"] == "hard" for r in rows) / len(rows) < 0.55
    for r in rows:
        kind, a, b = tu.parse_prompt(r["prompt"])
        assert kind == r["kind"] and int(r["answer"]) == (a * b if kind == "hard" else a + b)
        assert tu.verify(r["solution"], r["answer"]) == 1.0
        if kind == "hard":  # the habit is plausible and wrong (operands are never multiples of ten)
            assert tu.estimate(r["prompt"]) != int(r["answer"])
    assert tu.generate(50, "train", 3) == tu.generate(50, "train", 3)


def test_reward_reads_only_the_final_answer():
    ok = {"reward": 1.0, "tool_calls": 1.0, "format": 1.0}
    assert tu.reward("47*86=?", TOOL_SOLUTION, answer="4042") == ok
    assert tu.reward("47+6=?", "#53", answer="53") == {
        "reward": 1.0,
        "tool_calls": 0.0,
        "format": 1.0,
    }
    call = TOOL_SOLUTION.split("\n<tool_response>")[0]
    cases = {
        "#4500": 0.0,  # the habit
        call + "\n<tool_response>4042</tool_response>\n": 0.0,  # the tool's answer was never given
        call + "\n<tool_response>#4042</tool_response>\n": 0.0,  # a '#' inside a tool response
        call + "\n<tool_response>4042</tool_response>\n#4042#1": 0.0,  # run-on
        TOOL_SOLUTION + "\n<tool_call>": 0.0,  # run-on
        "4042": 0.0,  # no '#'
        "#40x42": 0.0,
        "": 0.0,
        "  #4042 ": 1.0,
    }
    for completion, want in cases.items():
        assert tu.reward("47*86=?", completion, answer="4042")["reward"] == want, completion
    assert tu.reward("47*86=?", TOOL_SOLUTION) is None
    assert tu.reward("47*86=?", TOOL_SOLUTION, answer=" ") is None
    assert tu.verify("#12", "n/a") == 0.0
    assert tu.reward("47*86=?", TOOL_SOLUTION, ground_truth=4042)["reward"] == 1.0


def test_eval_split_is_disjoint_from_every_train_split():
    ev = tu.generate(300, "eval", 0)
    assert len({r["prompt"] for r in ev}) == 300 and all(tu.is_eval_prompt(r["prompt"]) for r in ev)
    assert sum(r["kind"] == "hard" for r in ev) >= 200
    for seed in (0, 1):
        train = tu.generate(3000, "train", seed)
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in ev}


def test_demonstrations_and_their_loss_masks(tok):
    rows = tu.generate(3000, "train", 1)
    demos = tu.demonstrations(rows, 0.3, seed=2)
    assert demos == tu.demonstrations(rows, 0.3, seed=2)
    hard_tool = []
    for r, segs in zip(rows, demos, strict=True):
        text = "".join(t for t, _ in segs)
        if r["kind"] == "easy":
            assert segs == [(f"#{r['answer']}", True)]
            continue
        hard_tool.append(len(segs) == 3)
        if len(segs) == 3:  # call (model) - response (environment) - answer (model)
            assert [m for _, m in segs] == [True, False, True] and text == r["solution"]
            assert tu.verify(text, r["answer"]) == 1.0
        else:
            assert text == f"#{tu.estimate(r['prompt'])}" and tu.verify(text, r["answer"]) == 0.0
    assert 0.25 < sum(hard_tool) / len(hard_tool) < 0.35
    with pytest.raises(ValueError):
        tu.demonstration("47*86=?", random.Random(0), 1.5)

    segs = tu.transcript("47*86=?", "tool")
    ids, weight = encode_transcript(tok, "47*86=?", segs)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(ids) == len(weight)
    assert tok.unk_token_id not in ids
    prompt_len = 1 + len("47*86=?")
    assert weight[:prompt_len] == [0.0] * prompt_len
    masked = [i for i, w in zip(ids[prompt_len:], weight[prompt_len:], strict=True) if w == 0.0]
    assert tok.decode(masked) == "\n<tool_response>4042</tool_response>\n"
    trained = [i for i, w in zip(ids, weight, strict=True) if w == 1.0]
    assert tok.decode(trained, skip_special_tokens=True) == segs[0][0] + "#4042"
    # a plain completion keeps its old warm-up fingerprint; transcripts get their own
    assert _fingerprint([("a", "b")], {}) != _fingerprint([("a", [("b", True)])], {})
    assert _fingerprint([("a", [("b", True)])], {}) != _fingerprint([("a", [("b", False)])], {})


def test_format_matches_the_environment_and_the_calculator(tok):
    """The demos write exactly what ToolEnv parses, what the calculator answers and what the turn
    template appends, so the warm-up teaches the format RL runs in."""
    calls, errors = parse_tool_calls(tu.tool_call_text("47*86"))
    assert not errors and [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"expression": "47*86"})
    ]
    assert calculator("47*86") == "4042"
    tt = TurnTemplate(tok)
    assert not tt.chat
    assert tt.observation_text(["4042"], "tool") == tu.tool_response_text("4042")
    assert tuple(ToolEnv(tools=["calculator"]).stop) == (tu.CALL_CLOSE,)


def test_alphabet_covers_every_character(tok):
    rows = tu.generate(1000, "train", 0) + tu.generate(100, "eval", 0)
    texts = [r["prompt"] for r in rows]
    for r in rows:
        texts += [
            "".join(t for t, _ in tu.transcript(r["prompt"], s))
            for s in ("tool", "direct", "habit")
        ]
    # what the environment may answer besides a number: error observations
    texts += [
        "error: CalculatorError: not an expression: invalid syntax",
        "error: unknown tool 'python' (tools: calculator)",
        "error: tool call limit reached (max_tool_calls=2)",
        "error: bad_call: tool call is not valid JSON: Expecting value: line 1 column 1 (char 0)",
    ]
    chars = set("".join(texts))
    assert chars <= set(tu.ALPHABET), chars - set(tu.ALPHABET)
    for t in texts:
        assert tok.unk_token_id not in tok(t, add_special_tokens=False)["input_ids"], t
    assert len(set(tu.ALPHABET)) == len(tu.ALPHABET)


class _ScriptedEngine:
    """Answers each turn with scripted text; checks the episode loop resumes after every token so
    far."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns = tok, turns
        self.seen: list[tuple[int, list[int], tuple[str, ...]]] = []

    async def generate_all(self, req, timeout=None):
        self.seen.append((req.turn, req.resume_ids.tolist(), req.params.stop))
        text = self.turns[req.turn]
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if not text.endswith(tu.CALL_CLOSE):
            ids = [*ids, self.tok.eos_token_id]
        return {req.req_id: (np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop")}


def _episode(tok, turns: list[str], limits: EnvLimits | None = None, max_tokens: int = 160):
    engine = _ScriptedEngine(tok, turns)
    row = {"prompt": "47*86=?", "answer": "4042", "kind": "hard"}
    episodes = Episodes(
        ToolEnv(tools=["calculator"]), DirectToolClient(), limits or EnvLimits(max_turns=3)
    )
    ep = asyncio.run(
        run_episode(
            engine,
            tok,
            episodes,
            HeldOut(prompt_ids(tok, row["prompt"]), row["prompt"], row),
            "u1",
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            TurnTemplate(tok),
        )
    )
    return ep, engine


def test_episode_loop_appends_env_tokens_with_mask_zero(tok):
    call = tu.tool_call_text("47*86")
    ep, engine = _episode(tok, [call, "#4042"])
    assert ep.completion == TOOL_SOLUTION and ep.finish == "stop"
    assert (ep.turns, ep.tool_calls, ep.tool_errors) == (2, 1, 0)
    assert tu.verify(ep.completion, "4042") == 1.0
    obs = tok("\n<tool_response>4042</tool_response>\n", add_special_tokens=False)["input_ids"]
    n_call = len(call)
    assert ep.loss_mask == [1] * n_call + [0] * len(obs) + [1] * (len("#4042") + 1)
    assert ep.response_ids[n_call : n_call + len(obs)] == obs
    # turn 1 resumed after the call and the tool's answer; every turn stops at </tool_call>
    assert engine.seen[1][1] == ep.response_ids[: n_call + len(obs)]
    assert all(stop == (tu.CALL_CLOSE,) for _, _, stop in engine.seen)


def test_episode_loop_limits_and_tool_errors(tok):
    bad = '<tool_call>{"name":"calculator","arguments":{"expression":"4**"}}</tool_call>'
    ep, _ = _episode(tok, [bad, bad, bad], EnvLimits(max_turns=2), max_tokens=1000)
    assert ep.finish == "turns" and ep.turns == 2 and ep.tool_calls == 2 and ep.tool_errors == 2
    assert "error:" in ep.completion and tu.verify(ep.completion, "4042") == 0.0
    row = {"prompt": "47*86=?", "answer": "4042", "kind": "hard"}
    prompt = HeldOut(prompt_ids(tok, row["prompt"]), row["prompt"], row)
    reward = tu.verify(ep.completion, row["answer"])
    summary = summarize_outcomes([Outcome(prompt, ep.completion, len(ep.response_ids), reward, ep)])
    assert summary["accuracy"] == 0.0 and summary["hard"]["tool_rate"] == 1.0


def test_summary_and_markdown():
    def res(acc, rate):
        return {
            "accuracy": acc,
            "prompts": 300,
            "tool_rate": rate,
            "hard": {"accuracy": acc, "tool_rate": rate},
            "easy": {"accuracy": 0.9, "tool_rate": 0.0},
        }

    before = res(0.2, 0.0)
    curve = [
        point(before, t=0.0, step=0, version=0),
        point(res(0.8, 1.0), t=50.0, step=20, version=20),
    ]
    metrics = [
        {"step": i, "time": float(i), "reward": 0.5 + i / 100, "episode/tool_calls": 0.3}
        for i in range(1, 21)
    ]
    run = {"curve": curve, "metrics": metrics, "wall_clock_s": 60.0}
    s = summarize("laminar", run, before, 100.0)
    assert s["eval_accuracy_before"] == 0.2 and s["eval_accuracy_after"] == 0.8
    assert s["hard_tool_rate_before"] == 0.0 and s["hard_tool_rate_after"] == 1.0
    assert list(s["multiturn_metrics_mean"]) == ["episode/tool_calls"]
    assert s["multiturn_metrics_mean"]["episode/tool_calls"] == pytest.approx(0.3)
    md = summary_md(s)
    assert "| tool-call rate on hard prompts | 0.000 | 1.000 |" in md
    json.dumps(s)

"""Inputs are checked before any node starts: a bad model path, data file or function is one
clear line and exit 2, with nothing started and no run directory made.

    .venv/bin/python -m pytest tests/test_preflight.py -q
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminar.cli import main as cli_main
from laminar.config import load_config
from laminar.preflight import input_problems

REPO = Path(__file__).resolve().parent.parent
SKELETON = REPO / "configs" / "skeleton.yaml"
ALL = ("manager", "buffer", "relay", "trainer", "rollout")


@pytest.fixture
def inputs(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A model directory (just config.json: nothing loads it here), a prompts file, a reward
    module."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "pf_reward.py").write_text(
        "def score(prompt, completion, **row):\n    return float(completion == row['answer'])\n"
    )
    yield {"model": model, "data": data}
    for name in ("pf_reward", "pf_broken_reward"):  # imported from this tmp_path: forget them
        sys.modules.pop(name, None)


def _torch_cfg(inputs: dict[str, Path], *extra: str):
    return load_config(
        SKELETON,
        [
            "trainer.engine=torch",
            "rollout.engine=torch",
            f"model.path={inputs['model']}",
            f"data.train={inputs['data']}",
            *extra,
        ],
    )


def test_good_inputs_pass_and_a_reward_module_in_the_current_directory_imports(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # `laminar run` children import from here (python -m)
    assert input_problems(_torch_cfg(inputs, "reward.fn=pf_reward:score"), ALL) == []
    # the skeleton (sim engines) needs no model and no data
    assert input_problems(load_config(SKELETON), ALL) == []


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.path={tmp}/nope", "model.path '{tmp}/nope' does not exist"),
        ("model.path={tmp}/train.jsonl", "is a file; give the model's directory"),
        ("model.path={tmp}", "has no config.json"),
        ("data.train={tmp}/missing.jsonl", "data.train '{tmp}/missing.jsonl' does not exist"),
        ("data.train={tmp}/pf_reward.py", "use a .jsonl/.json/.parquet file"),
        ("data.eval={tmp}/eval.parquet", "data.eval '{tmp}/eval.parquet' does not exist"),
        ("reward.fn=no_such_module:score", "no module named 'no_such_module'"),
        ("reward.fn=pf_reward:scor", "module 'pf_reward' has no 'scor' (it has: score)"),
        ("reward.fn=pf_reward", "must look like 'package.module:function'"),
        ("env.fn=json:decoder", "env.fn 'json:decoder' is a module, not a function"),
        ("trainer.resume={tmp}", "is not a checkpoint directory (no meta.json)"),
    ],
)
def test_each_bad_input_is_named_with_its_fix(
    inputs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    override: str,
    expected: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    problems = input_problems(_torch_cfg(inputs, override.format(tmp=tmp_path)), ALL)
    assert len(problems) == 1 and expected.format(tmp=tmp_path) in problems[0], problems


def test_a_hub_id_gets_one_line_saying_download_it_first(inputs: dict[str, Path]) -> None:
    problems = input_problems(_torch_cfg(inputs, "model.path=Qwen/Qwen2.5-0.5B-Instruct"), ALL)
    assert problems == [
        "model.path 'Qwen/Qwen2.5-0.5B-Instruct' looks like a Hugging Face hub id, but models load "
        "from a local path only: download it first (`huggingface-cli download "
        "Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct`) and set "
        "model.path=models/Qwen2.5-0.5B-Instruct"
    ]
    # a relative local path that is missing is just missing, not a hub id
    (problem,) = input_problems(_torch_cfg(inputs, "model.path=models/Qwen2.5-0.5B"), ALL)
    assert problem.startswith("model.path 'models/Qwen2.5-0.5B' does not exist (relative to ")


def test_a_reward_module_that_raises_on_import_says_so(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pf_broken_reward.py").write_text("import json\nraise RuntimeError('no key set')\n")
    monkeypatch.chdir(tmp_path)
    (problem,) = input_problems(_torch_cfg(inputs, "reward.fn=pf_broken_reward:score"), ALL)
    assert "importing 'pf_broken_reward' raised RuntimeError: no key set" in problem


def test_unset_model_and_data_for_torch_engines_are_named() -> None:
    cfg = load_config(SKELETON, ["trainer.engine=torch", "rollout.engine=torch"])
    problems = input_problems(cfg, ALL)
    assert len(problems) == 2
    assert problems[0].startswith(
        "model.path is not set; trainer.engine=torch, rollout.engine=torch"
    )
    assert problems[1].startswith("data.train is not set; rollout.engine=torch needs prompts")
    # a role that is not started is not checked: a buffer-only host needs no model
    assert input_problems(cfg, ["buffer"]) == []


def test_laminar_run_refuses_before_starting_anything(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    rc = cli_main(
        [
            "run",
            str(SKELETON),
            f"run_dir={run_dir}",
            "trainer.engine=torch",
            "model.path=Qwen/Qwen2.5-0.5B",
            f"data.train={tmp_path}/missing.jsonl",
            "reward.fn=laminar.rewards.builtin:no_such_reward",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "3 problems with the run's inputs" in err
    assert "download it first" in err and "missing.jsonl' does not exist" in err
    assert "has no 'no_such_reward' (it has: " in err and "exact_match" in err
    assert "Traceback" not in err and not run_dir.exists()  # nothing started, nothing written


def test_laminar_node_outside_run_checks_its_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.delenv("LAMINAR_PARENT_PID", raising=False)
    rc = cli_main(
        [
            "node",
            "--role",
            "buffer",
            "--config",
            str(SKELETON),
            f"data.train={tmp_path}/nope.parquet",
        ]
    )
    assert rc == 2
    assert f"data.train '{tmp_path}/nope.parquet' does not exist" in capsys.readouterr().err

"""The README's "Train your own" commands, run as written: examples/ builds its model and data,
trains.

    .venv/bin/python -m pytest tests/test_examples.py -q           # prepare + the jsonl run (~25 s)
    .venv/bin/python -m pytest tests/test_examples.py -q -m slow   # every command of the section

The commands are read from the README section's first bash block and run with bash in a
scratch directory that links `examples/` to the repository's (so relative paths resolve the
way they do from the repository root), with .venv's bin first on PATH. Each `laminar run`
gets test-only overrides appended: a few steps and a short private ipc directory. A run that
hangs is stopped by its deadline: the test kills the bash it started and the node pids that
launcher recorded in run_dir/pids.json, nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
RUN_DEADLINE_S = 240.0  # five processes importing torch on 2 busy cores, then a few tiny steps


def readme_commands() -> list[str]:
    """The commands of the README's "Train your own" section (its first bash block), comments
    removed."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Train your own\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README 'Train your own' has no bash block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def _kill_recorded(work: Path) -> None:
    for pids_file in work.glob("runs/*/pids.json"):
        for pid in json.loads(pids_file.read_text()).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_documented(command: str, work: Path, ipc_dir: Path) -> str:
    """Run one README command in `work`; returns its output, fails with it on a non-zero exit."""
    if command.startswith("laminar run"):
        command += f" trainer.total_steps={STEPS} cluster.ipc_dir={ipc_dir} logging.level=warning"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    log = work / "command.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=RUN_DEADLINE_S)
        except subprocess.TimeoutExpired:
            _kill_recorded(work)
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for bash
            proc.wait(10)
            raise AssertionError(
                f"{command!r} ran past {RUN_DEADLINE_S}s:\n{log.read_text()}"
            ) from None
    output = log.read_text()
    assert rc == 0, f"{command!r} exited {rc}:\n{output}"
    return output


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    return tmp_path


def check_run(run_dir: Path) -> list[dict]:
    """A finished example run: a loadable checkpoint, metrics for every step, completions with
    rewards."""
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model"
    found = sorted(run_dir.rglob("*"))
    assert (ckpt / "config.json").is_file() and list(ckpt.glob("*.safetensors")), found
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"] for m in steps if "reward" in m} == set(range(1, STEPS + 1))
    rows = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    trained = [r for r in rows if not r.get("eval")]
    assert trained and all(r["prompt"].startswith("reverse ") for r in trained)
    # a float, not None: the reward found the reference (answer or reward_model.ground_truth)
    assert all(
        isinstance(r["reward"], float) and "completion" in r and "version" in r for r in trained
    )
    return trained


def test_readme_section_is_the_example() -> None:
    cmds = readme_commands()
    assert cmds[0] == "python examples/prepare.py"
    assert len(cmds) >= 2
    assert all(c.startswith("laminar run examples/config.yaml") for c in cmds[1:])


def test_prepare_and_train_on_jsonl(work: Path, short_dir: Path) -> None:
    prepare, train_jsonl = readme_commands()[:2]
    run_documented(prepare, work, short_dir)
    data = work / "runs" / "example-data"
    assert (data / "model" / "config.json").is_file() and (data / "train.parquet").is_file()
    first = json.loads((data / "train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"prompt", "answer", "partial_credit"}
    run_documented(train_jsonl, work, short_dir)
    check_run(work / "runs" / "example")


@pytest.mark.slow
def test_every_documented_command(work: Path, short_dir: Path) -> None:
    for command in readme_commands():
        run_documented(command, work, short_dir)
    check_run(work / "runs" / "example")
    check_run(work / "runs" / "example-verl")  # parquet, chat messages, reward_model.ground_truth

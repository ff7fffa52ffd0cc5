"""Runs are explicit: a finished run is refused (--resume, --overwrite or a new name), an
unfinished one resumes and says so; `laminar keys` never overwrites without --force;
`laminar --version`; a real `laminar run` leaves node logs and removes its ipc directory.

    .venv/bin/python -m pytest tests/test_run_dir.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from laminar import __version__
from laminar.cli import main as cli_main
from laminar.config import load_config
from laminar.rundir import RunDirError, clear_run, inspect_run

REPO = Path(__file__).resolve().parent.parent
SKELETON = REPO / "configs" / "skeleton.yaml"
RUN_DEADLINE_S = 120.0  # five processes starting on 2 busy cores


def _checkpoint(run_dir: Path, step: int, reason: str = "periodic") -> Path:
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "version": step, "reason": reason}))
    return ckpt


def _ran_with(run_dir: Path, total_steps: int) -> None:
    """The resolved config a previous `laminar run` left behind."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"total_steps": total_steps}}))


def _cfg(run_dir: Path, total: int = 5):
    return load_config(SKELETON, [f"run_dir={run_dir}", f"trainer.total_steps={total}"])


def test_inspect_run_classifies_new_unfinished_and_finished(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert inspect_run(_cfg(run)).state == "new"
    run.mkdir()
    (run / "nodes.log").write_text("a run that never got going\n")
    assert inspect_run(_cfg(run)).state == "new"
    (run / "buffer-0.journal").write_bytes(b"\x01")
    prior = inspect_run(_cfg(run))
    assert (prior.state, prior.step) == ("unfinished", 0) and "buffer-0.journal" in prior.why
    _ran_with(run, 5)
    _checkpoint(run, 2, "stop")
    (run / "checkpoints" / ".tmp-step_4-123").mkdir()  # a checkpoint that never completed
    prior = inspect_run(_cfg(run))
    assert (prior.state, prior.step) == ("unfinished", 2)
    _checkpoint(run, 5, "final")
    prior = inspect_run(_cfg(run))
    assert (prior.state, prior.step, prior.checkpoint) == (
        "finished",
        5,
        run / "checkpoints" / "step_00000005",
    )
    # more steps asked for: the same run is unfinished again
    assert inspect_run(_cfg(run, total=8)).state == "unfinished"


def test_a_run_whose_data_ran_out_is_finished(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ran_with(run, 100)
    _checkpoint(run, 30, "final")  # the trainer stopped at 30 of 100: data.epochs done
    prior = inspect_run(_cfg(run, total=100))
    assert prior.state == "finished" and "data ran out at step 30" in prior.why


def test_run_refuses_a_finished_run_and_names_the_options(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    _ran_with(run, 5)
    _checkpoint(run, 5, "final")
    before = (run / "config.yaml").read_text()
    args = [str(SKELETON), f"run_dir={run}", "trainer.total_steps=5"]
    assert cli_main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert f"{run} holds a finished run (step 5 of trainer.total_steps=5" in err
    assert "--resume" in err and "--overwrite" in err and "name=NAME" in err
    # --resume of a finished run: nothing to train, said so, exit 0, nothing started or rewritten
    assert cli_main(["run", *args, "--resume"]) == 0
    assert "already finished" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == before and not (run / "pids.json").exists()
    # --resume with nothing to resume is a mistake
    assert cli_main(["run", str(SKELETON), f"run_dir={tmp_path}/fresh", "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_clear_run_deletes_only_run_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"x")
    with pytest.raises(RunDirError, match="not a laminar run directory"):
        clear_run(other)
    assert (other / "cat.jpg").exists()
    run = tmp_path / "run"
    _ran_with(run, 5)
    monkeypatch.chdir(run)
    with pytest.raises(RunDirError, match="holds the current, home or root directory"):
        clear_run(run)
    monkeypatch.chdir(tmp_path)
    clear_run(run)
    assert not run.exists()


def test_keys_refuse_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    keys = tmp_path / "keys"
    assert cli_main(["keys", str(keys)]) == 0
    secret = (keys / "node.key_secret").read_bytes()
    assert cli_main(["keys", str(keys)]) == 2
    err = capsys.readouterr().err
    assert "node.key exists" in err and "Use --force to replace it" in err
    assert (keys / "node.key_secret").read_bytes() == secret
    assert cli_main(["keys", str(keys), "--name", "host2"]) == 0  # another pair beside it is fine
    assert cli_main(["keys", str(keys), "--force"]) == 0
    assert (keys / "node.key_secret").read_bytes() != secret
    assert (keys / "authorized" / "node.key").read_bytes() == (keys / "node.key").read_bytes()


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "laminar", "--version"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and out.stdout.strip() == f"laminar {__version__}"


def test_a_finished_run_keeps_node_logs_removes_its_ipc_dir_and_is_refused_again(
    tmp_path: Path, short_dir: Path
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(16)))
    run, ipc = tmp_path / "run", short_dir / "ipc"
    cmd = [
        sys.executable,
        "-m",
        "laminar",
        "run",
        str(SKELETON),
        f"run_dir={run}",
        f"cluster.ipc_dir={ipc}",
        f"data.train={data}",
        "trainer.total_steps=2",
        "trainer.batch_groups=1",
        "logging.progress_every_s=0",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_DEADLINE_S, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trainer finished" in out.stderr
    logs = {p.name: p.read_text() for p in (run / "logs").iterdir()}
    assert "trainer-0.log" in logs and '"event": "checkpoint"' in logs["trainer-0.log"]
    shown = set(out.stderr.splitlines())
    assert all(line in shown for text in logs.values() for line in text.splitlines())  # teed
    assert not ipc.exists()  # sockets and their directory gone
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert again.returncode == 2 and "holds a finished run (step 2 of" in again.stderr

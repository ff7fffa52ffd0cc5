"""The import rules of docs/DESIGN.md hold, and their check can fail.

`make lint` runs `lint-imports` (import-linter, contracts in pyproject.toml's
[tool.importlinter]). These tests run the same contracts on this tree, then on a copy of it
with one rule broken at a time, so a contract that silently passes everything is caught.

.venv/bin/python -m pytest tests/test_import_rules.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the `laminar` package of `tree` with that tree's pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT), "--no-cache", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package and its contracts, to break."""
    shutil.copytree(
        ROOT / "laminar", tmp_path / "laminar", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(tree: Path, module: str, line: str) -> None:
    path = tree / module
    text = path.read_text()
    # after the module docstring and `from __future__`, where imports go
    anchor = "from __future__ import annotations\n"
    assert anchor in text, module
    path.write_text(text.replace(anchor, anchor + line + "\n", 1))


def test_the_tree_keeps_every_contract() -> None:
    res = lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # the wire learns of a role
        ("laminar/transport/codec.py", "import laminar.buffer.ledger", "the wire"),
        # a role reaches into another role
        ("laminar/rollout/feeder.py", "import laminar.buffer.ledger", "imports go down"),
        # a part sees its node
        ("laminar/buffer/ledger.py", "import laminar.buffer.node", "never import a node"),
        # models/ climbs to the engines
        ("laminar/models/decoder_lm.py", "import laminar.engines.sim", "models/ and algo/"),
        # a shared package imports a role (a lower layer a higher one)
        ("laminar/weights/layout.py", "import laminar.trainer.node", "imports go down"),
    ],
)
def test_a_broken_rule_fails_the_check(tree: Path, module: str, line: str, contract: str) -> None:
    add_import(tree, module, line)
    res = lint(tree)
    assert res.returncode != 0, res.stdout
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, res.stdout


def test_an_import_circle_inside_a_package_fails_the_check(tree: Path) -> None:
    # the buffer's ledger imports its journal; the journal importing the ledger back is a circle
    add_import(tree, "laminar/buffer/journal.py", "import laminar.buffer.ledger")
    res = lint(tree)
    assert res.returncode != 0, res.stdout
    assert "No cycles are allowed in laminar.buffer" in res.stdout, res.stdout

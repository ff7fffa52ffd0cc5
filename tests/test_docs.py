"""The user docs stay true: the generated config reference, the metrics glossary, the README's
minimal config.

    .venv/bin/python -m pytest tests/test_docs.py -q        # ~15 s (one short in-process run)

docs/config.md must be what `python -m laminar.config_doc` prints. docs/metrics.md must list
every key a short run of the demo's config writes to metrics.jsonl: configs/demo.yaml with a
tiny random model, a few count-up rows and a coin-flip reward (so groups disagree and the loss
path runs), every role in this process over inproc (LocalCluster), 3 steps and a validation.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from pathlib import Path

from laminar.config import load_config

REPO = Path(__file__).resolve().parents[1]


def coin_reward(prompt: str, completion: str, **row: object) -> float:
    """0 or 1 from a hash of the completion: rewards within a group differ, advantages are
    not all 0, so the run goes through the loss and writes its statistics."""
    return float(zlib.crc32(completion.encode()) % 2)


def test_config_reference_is_current() -> None:
    from laminar.config_doc import REGENERATE, render

    doc = REPO / "docs" / "config.md"
    assert doc.exists() and doc.read_text() == render(), (
        f"docs/config.md is out of date with laminar/config.py: run `{REGENERATE}`"
    )


def glossary_patterns() -> list[re.Pattern[str]]:
    """Every key of docs/metrics.md's tables (first column, in backticks); `<x>` matches one
    path part."""
    keys = []
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            keys += re.findall(r"`([^`]+)`", first_cell)
    assert keys, "docs/metrics.md lists no keys"
    return [re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(k))) for k in keys]


def test_metrics_glossary_covers_a_short_run(tmp_path: Path) -> None:
    from laminar.cluster import LocalCluster
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import countup

    model = build_tiny_model(
        tmp_path / "model",
        alphabet=countup.ALPHABET,
        hidden=32,
        layers=1,
        heads=2,
        kv_heads=1,
        max_positions=128,
    )
    train = countup.write_jsonl(countup.generate(64, "train", 0), tmp_path / "train.jsonl")
    held = countup.write_jsonl(countup.generate(8, "eval", 0), tmp_path / "eval.jsonl")
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            f"name=docs{zlib.crc32(str(tmp_path).encode()) % 10**6}",
            f"run_dir={tmp_path / 'run'}",
            f"model.path={model}",
            f"data.train={train}",
            f"data.eval={held}",
            f"reward.fn={__name__}:coin_reward",
            "rollout.group_size=4",
            "rollout.max_model_len=128",
            "rollout.sampling.max_tokens=24",
            "trainer.total_steps=3",
            "trainer.batch_groups=2",
            "trainer.warmup_steps=0",
            "trainer.snapshot_every=0",
            "trainer.eval_every=2",
            "trainer.eval_rows=4",
            "cluster.nice={}",
        ],
    )

    async def run() -> None:
        async with LocalCluster(cfg) as cluster:
            await cluster.wait_trainer(timeout=180)

    asyncio.run(run())
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    written = {k for line in lines for k in line}
    assert "loss/pg" in written and "eval/accuracy" in written, sorted(written)  # not vacuous
    patterns = glossary_patterns()
    missing = sorted(k for k in written if not any(p.fullmatch(k) for p in patterns))
    assert not missing, f"metrics.jsonl keys missing from docs/metrics.md: {missing}"


def test_readme_minimal_config_validates(tmp_path: Path) -> None:
    """The README's "Minimal config" YAML block loads with the real schema."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Minimal config\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "README 'Minimal config' has no yaml block"
    path = tmp_path / "minimal.yaml"
    path.write_text(block.group(1))
    cfg = load_config(path)
    assert cfg.model.path and cfg.data.train and cfg.reward.fn

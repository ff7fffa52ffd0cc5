"""Config: every YAML in configs/ and examples/ loads; wrong input names the field; importing the
config stays light.

.venv/bin/python -m pytest tests/test_config.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.config import ConfigError, LaminarConfig, dump_config, load_config, write_resolved
from laminar.launch.tuning import autogroup_nice

_REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted([*(_REPO / "configs").glob("*.y*ml"), *(_REPO / "examples").glob("*.y*ml")])


def test_there_are_configs() -> None:
    names = {p.name for p in CONFIGS}
    assert {"skeleton.yaml", "gpu_qwen.yaml", "config.yaml"} <= names  # config.yaml: examples/


@pytest.mark.parametrize("path", CONFIGS, ids=[f"{p.parent.name}/{p.name}" for p in CONFIGS])
def test_every_config_loads_and_survives_a_resolve_roundtrip(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, LaminarConfig)
    again = load_config(write_resolved(cfg, tmp_path))  # what `laminar run` hands to every node
    assert again == cfg


def test_overrides_are_parsed_as_yaml() -> None:
    cfg = load_config(
        None,
        [
            "trainer.lr=3e-6",
            "cluster.roles={rollout: 3, manager: 1}",
            "data.epochs=null",
            "rollout.sampling.stop=[a, b]",
            "logging.json_logs=true",
            "demo.model.hidden=64",
        ],
    )
    assert cfg.trainer.lr == 3e-6 and cfg.cluster.roles == {"rollout": 3, "manager": 1}
    assert cfg.data.epochs is None and cfg.rollout.sampling.stop == ["a", "b"]
    assert cfg.logging.json_logs is True and cfg.demo is not None and cfg.demo.model.hidden == 64


def test_the_old_extra_section_names_its_replacements():
    with pytest.raises(ConfigError, match=r"`extra` is gone: .*demo.*trainer.sim_weight_bytes"):
        load_config(None, ["extra.demo.skip_sync=true"])
    with pytest.raises(ConfigError, match="demo.curve_eval_rows"):
        load_config(None, ["demo.eval_rows=10", "demo.curve_eval_rows=20"])


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "names"),
    [
        ("bogus: 1\n", [], ["bogus", "unknown field"]),
        (
            "transport:\n  heartbeat_intervl_s: 1\n",
            [],
            ["transport.heartbeat_intervl_s", "unknown field"],
        ),
        (
            "transport:\n  heartbeat_liveness: many\n",
            [],
            ["transport.heartbeat_liveness", "'many'"],
        ),
        (
            "transport:\n  heartbeat_interval_s: -1\n",
            [],
            ["transport.heartbeat_interval_s", "greater than 0"],
        ),
        ("mode: fastest\n", [], ["mode", "'fastest'"]),
        ("cluster:\n  roles: {janitor: 1}\n", [], ["cluster.roles", "janitor"]),
        ("", ["trainer.lrr=1"], ["trainer.lrr", "unknown field"]),
        ("", ["trainer.lr=fast"], ["trainer.lr", "'fast'"]),
        ("", ["trainer.lr"], ["trainer.lr", "key=value"]),
        ("", ["trainer..lr=1"], ["trainer..lr", "empty key part"]),
        ("name: x\n", ["name.x=1"], ["name.x=1", "'name' is a value, not a section"]),
        ("", ["name.x=1"], ["name", "valid string"]),
        ("", ["trainer.lr=[1"], ["trainer.lr", "not valid YAML"]),
        ("[1, 2]\n", [], ["mapping"]),
        ("a: [\n", [], ["not valid YAML"]),
    ],
)
def test_config_errors_name_the_field(
    tmp_path: Path, yaml_text: str, overrides: list[str], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, yaml_text), overrides)
    for name in names:
        assert name in str(info.value), f"{name!r} not in: {info.value}"


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_dump_is_loadable_yaml() -> None:
    cfg = load_config(None, ["name=x", "trainer.betas=[0.8, 0.9]"])
    assert "name: x" in dump_config(cfg)


def test_import_config_pulls_in_no_torch_zmq_or_transformers() -> None:
    code = (
        "import sys, laminar.config, laminar.cli; print(sorted(m for m in ('torch', 'zmq', "
        "'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_node_processes_set_the_garbage_collector_threshold() -> None:
    import gc

    from laminar.launch.tuning import setup_process

    old = gc.get_threshold()
    try:
        cfg = load_config(None, ["cluster.gc_threshold=[1000, 20, 50]", "logging.level=warning"])
        setup_process(cfg)
        assert gc.get_threshold() == (1000, 20, 50)
        gc.set_threshold(*old)
        setup_process(load_config(None, ["cluster.gc_threshold=null", "logging.level=warning"]))
        assert gc.get_threshold() == old  # null: left as it is
        assert load_config(None).cluster.gc_threshold == (700, 10, 100)
        with pytest.raises(ConfigError, match="gc_threshold"):
            load_config(None, ["cluster.gc_threshold=[0, 10, 10]"])
    finally:
        gc.set_threshold(*old)


_NICE_CHILD = """
import json, os, sys
from pathlib import Path
from laminar.config import load_config
from laminar.launch.tuning import autogroup_nice as group, lower_priority
cfg = load_config(None, ["cluster.nice.rollout=7"])
fake = Path(sys.argv[1])
before, group_before = os.getpriority(os.PRIO_PROCESS, 0), group()
lower_priority(cfg, "trainer", fake)
mid = os.getpriority(os.PRIO_PROCESS, 0)
lower_priority(cfg, "rollout", fake)
lower_priority(cfg, "rollout")
print(json.dumps({"before": before, "trainer": mid - before,
                  "rollout": os.getpriority(os.PRIO_PROCESS, 0) - before,
                  "group_before": group_before, "group_after": group(), "fake": fake.read_text()}))
"""


@pytest.mark.parametrize(
    ("own_session", "group_file", "group_after"),
    [
        (True, "/autogroup-12 nice 3\n", "10"),
        (False, "/autogroup-12 nice 3\n", "/autogroup-12 nice 3\n"),  # a shell's session: untouched
        (True, "", ""),  # the root group (a session never made by setsid) reads empty: left as is
    ],
)
def test_roles_told_to_yield_lower_their_own_priority(
    tmp_path, own_session, group_file, group_after
) -> None:
    """cluster.nice raises the niceness of the role's processes (in a child: never this test's own),
    and a node that leads its session (as `laminar run` starts them) raises its autogroup's too."""
    fake = tmp_path / "autogroup"
    fake.write_text(group_file)
    out = subprocess.run(
        [sys.executable, "-c", _NICE_CHILD, str(fake)],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=own_session,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    b = got["before"]
    # trainer untouched; the rollout's +7 applied twice (the fake group, then the real one)
    assert (got["trainer"], got["rollout"]) == (0, min(19, b + 14) - b)
    assert got["fake"] == group_after
    if own_session and got["group_before"] is not None:
        assert got["group_after"] == min(19, got["group_before"] + 7)
    else:
        assert got["group_after"] == got["group_before"]  # a shell's session is never touched


def test_autogroup_nice_reads_the_group_or_none(tmp_path) -> None:
    f = tmp_path / "autogroup"
    assert autogroup_nice(f) is None  # a kernel without autogroup scheduling
    for text, want in (("/autogroup-7 nice -3\n", -3), ("", None), ("garbage", None)):
        f.write_text(text)
        assert autogroup_nice(f) == want


def test_nice_settings_are_checked() -> None:
    for bad, match in (
        ("cluster.nice.rollout=-2", "0-19"),
        ("cluster.nice.rollouts=3", "unknown role"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])

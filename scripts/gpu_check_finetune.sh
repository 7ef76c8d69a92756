#!/usr/bin/env bash
# LoRA and QLoRA fine-tunes of a ~1B Llama-shaped model on one GPU, measured memory against the
# estimator (see scripts/gpu_check_finetune.py).
#   scripts/gpu_check_finetune.sh [--steps 20] [--out DIR]
# Runs from a checkout with the machine's python3 (torch with CUDA, transformers, accelerate,
# pyyaml, psutil, pydantic); nothing of Frenzy needs installing. If a folder .whl/ of wheels
# is present (e.g. pydantic for a bare GPU box), they are installed into a private folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  site=${FRENZY_WHEEL_SITE:-/tmp/frenzy-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check_finetune.py "$@"

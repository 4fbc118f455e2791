#!/usr/bin/env bash
# Everything a GPU session runs, in one call (~8 min on an H200): the `gpu` tests, then the GPU
# suite. Logs, JSON and the suite's markdown table land in $OUT. Carry .whl (gpu_wheels.sh).
#   TESTS_S: time limit of the tests (default 150 s); SUITE_S: the suite's budget (300 s);
#   SUITE_ARGS: more suite arguments (`--dry-run` checks this script on a CPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi -L
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda',
torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__)"
  python3 -c "import slipstream.train, datasets, pydantic; print('imports ok')"
} 2>&1 | tee "$OUT/env.txt"
timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 \
  | tee "$OUT/gpu_tests.log"
python3 benchmarks/gpu_suite.py --budget-s "${SUITE_S:-300}" --out "$OUT/gpu_suite.json" ${SUITE_ARGS:-} 2>&1 \
  | tee "$OUT/gpu_suite.log"

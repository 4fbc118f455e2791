#!/usr/bin/env bash
# Everything a GPU session runs, in one call (<= ~9 min on an H200): the `gpu` tests, then the GPU
# suite. Logs, JSON and the suite's markdown table land in $OUT. Carry .whl (gpu_wheels.sh).
#   TESTS_S: time limit of the tests (default 240 s); SUITE_S: the suite's budget (270 s);
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
# The end-to-end trainer first, the attention tests (cold flex compiles) late, then any other
# gpu test (pytest skips paths it has already collected).
timeout "${TESTS_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs --durations=0 \
  tests/test_train_gpu.py tests/test_model_io.py tests/test_offload.py tests/test_loss.py \
  tests/test_moe_ops.py tests/test_qlora.py tests/test_debug.py tests/test_attention.py tests 2>&1 \
  | tee "$OUT/gpu_tests.log"
python3 benchmarks/gpu_suite.py --budget-s "${SUITE_S:-270}" --out "$OUT/gpu_suite.json" ${SUITE_ARGS:-} 2>&1 \
  | tee "$OUT/gpu_suite.log"

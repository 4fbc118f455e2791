#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the lent GPU machine's image lacks (Python 3.12,
# x86-64; it has torch 2.11, transformers, peft, triton, datasets' heavy deps, but no pydantic,
# datasets, gguf or bitsandbytes) into .whl/ (~45 MB, git-ignored). gpu_session.sh installs them.
# Pinned to the versions the CPU test suite runs with. flash-linear-attention (+ fla-core,
# einops): the Gated DeltaNet kernels Qwen3.5 uses on CUDA when they import (pure Python on
# the image's triton; the CPU suite runs without them).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing_extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 \
    bitsandbytes==0.50.2 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
du -sh .whl

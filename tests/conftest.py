"""Suite-wide settings: the test models are tiny, so torch runs them on one thread, and
`model.dtype: auto` means float32 on every CPU.

On the 2-core CI machine a (60 x 576) @ (576 x 1536) matmul took 12 ms on one thread and
64 ms on two while other processes were busy: thread hand-off dominates at these sizes.
OMP_NUM_THREADS=1 keeps runs (`prepare_run` sets the threads) and subprocesses at one too.

The tolerances of the suite are float32's: on a CPU with AVX512-BF16 or AMX, auto would pick
bf16, so SLIPSTREAM_CPU_BF16=0 pins it (subprocesses inherit it). The bf16 tests
(test_cpu_bf16.py) ask for bf16 explicitly.
"""

import os

import pytest
import torch
from helpers.runs import make_tiny_run

torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["SLIPSTREAM_CPU_BF16"] = "0"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(model folder, train.jsonl): a tiny Llama with a chat tokenizer and 48 chat rows."""
    return make_tiny_run(tmp_path_factory.mktemp("tiny"))

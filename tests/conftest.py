"""Suite-wide settings: the test models are tiny, so torch runs them on one thread.

On the 2-core CI machine a (60 x 576) @ (576 x 1536) matmul took 12 ms on one thread and
64 ms on two while other processes were busy: thread hand-off dominates at these sizes.
"""

import pytest
import torch
from helpers.runs import make_tiny_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(model folder, train.jsonl): a tiny Llama with a chat tokenizer and 48 chat rows."""
    return make_tiny_run(tmp_path_factory.mktemp("tiny"))

"""Suite-wide settings: the test models are tiny, so torch runs them on one thread.

On the 2-core CI machine a (60 x 576) @ (576 x 1536) matmul took 12 ms on one thread and
64 ms on two while other processes were busy: thread hand-off dominates at these sizes.
"""

import torch

torch.set_num_threads(1)

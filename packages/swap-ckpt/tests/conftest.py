"""swap-ckpt's test settings: tiny tensors, so one intra-op thread (more only adds contention on 2 cores)."""

import torch

torch.set_num_threads(1)

"""swap-generic's test settings.

The tensors here are small, so torch's intra-op thread pool only adds contention
(on a 2-core CI machine a fused step gets ~50x slower with 2 threads than with 1).
Both the plain and the swapped optimizer of every comparison run under the same setting.
"""

import torch

torch.set_num_threads(1)

import os

import torch

# Run Triton kernels on CPU through Triton's interpreter when there is no GPU; this must happen
# before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

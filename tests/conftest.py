"""Test-wide setup.

Without a GPU the Triton kernels run on CPU through Triton's interpreter. TRITON_INTERPRET must be
set before any kernel is defined, so it is set here, before a test module imports the package
(an explicit TRITON_INTERPRET in the environment is respected).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

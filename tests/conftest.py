"""Test-wide setup: the Triton kernels run on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before any kernel is defined, so it is set here, before the package
is imported by a test module (an explicit TRITON_INTERPRET=0 in the environment is respected).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

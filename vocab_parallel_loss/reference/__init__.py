"""Pure-PyTorch backends with the Triton kernels' semantics (CPU without the interpreter, no
Triton, float64)."""

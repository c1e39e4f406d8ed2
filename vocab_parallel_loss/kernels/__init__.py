"""Triton kernels and their host-side launch code (no autograd, no torch.distributed)."""

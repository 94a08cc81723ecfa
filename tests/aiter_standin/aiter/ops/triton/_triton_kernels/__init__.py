"""aiter.ops.triton._triton_kernels (stand-in)."""

"""aiter.ops.triton._triton_kernels.attention (stand-in)."""

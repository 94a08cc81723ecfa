"""Kernel sources (pure ``@triton.jit`` code; no jax imports below this package)."""

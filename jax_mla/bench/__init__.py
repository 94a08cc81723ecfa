"""Benchmarks: ``python -m jax_mla.bench`` (see ``__main__.py``)."""

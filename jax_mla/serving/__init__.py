"""Serving: the paged KV cache manager (``pages.py``, host side) and a continuous-batching
engine for the small MLA model of :mod:`jax_mla.model.transformer` (``engine.py``, the
``python -m jax_mla demo`` loop in ``demo.py``)."""

from jax_mla.serving.pages import CacheFull, PagedCacheManager

__all__ = ["CacheFull", "PagedCacheManager"]

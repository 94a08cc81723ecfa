"""``backend="xla"``: the exact reference (``jax_mla.reference``) on every platform.

Every head count, every dtype, no padding, no plan arrays: the :class:`Backend` defaults are
this backend.
"""

from jax_mla.backends.base import Backend


class XlaBackend(Backend):
    name = "xla"

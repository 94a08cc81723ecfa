"""Every environment knob jax_mla reads, in one place.

- ``JAX_MLA_POISON_OUTPUTS=1``: interpreted (CPU) kernels see their output buffers filled with
  NaN (floats) or -1 (ints) before they run, so a lane a kernel forgets to write is caught.
- ``TRITON_INTERPRET``: Triton's own switch; on CPU jax_mla sets it to 1 if triton is not yet
  imported (see ``backends/triton_launch.py``).
"""

from __future__ import annotations

import os


def poison_outputs() -> bool:
    return os.environ.get("JAX_MLA_POISON_OUTPUTS", "0") == "1"

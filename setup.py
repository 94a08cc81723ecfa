"""Builds jax_mla's FFI launcher (``ffi/``) as the extension ``jax_mla._triton_launch``.

Its sources: ``ffi/triton_launch.cc`` (ahead-of-time Triton kernels) and ``ffi/aiter_asm.cc``
(AITER's asm MLA decode ``.co`` kernels, loaded from the installed AITER at run time).

It is a plain shared library of XLA typed-FFI handlers (no Python module inside): compiled with
the system C++ compiler against the XLA FFI headers jaxlib ships (``jax.ffi.include_dir()``), no
CUDA or ROCm toolkit needed (the driver is opened at run time). Everything else about the
package is in ``pyproject.toml``. The extension is optional: without a C++ compiler the install
still succeeds, and the launcher says it is missing when a GPU path asks for it.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildFfi(build_ext):
    def build_extensions(self):
        import jax.ffi  # a build requirement (pyproject.toml)

        for ext in self.extensions:
            ext.include_dirs.append(jax.ffi.include_dir())
        super().build_extensions()

    def get_export_symbols(self, ext):
        return []  # handlers, not a Python module: no PyInit_ symbol to export


setup(
    ext_modules=[
        Extension(
            "jax_mla._triton_launch",
            sources=["ffi/triton_launch.cc", "ffi/aiter_asm.cc"],
            depends=["ffi/relaxed_capture.h"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-g0", "-fvisibility=hidden"],
            libraries=["dl"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildFfi},
)

"""Build hook for lowbit's compiled CPU kernels (see lowbit/kernels).

The extension is plain C++17 against XLA's FFI headers shipped in jaxlib. It is compiled
with baseline flags (no -march): AVX2 / AVX-512 code paths carry their own target
attributes and are picked at run time, so one build runs on any x86-64. A compiler error
fails the build; the pure-JAX fallback is for machines where the module is absent.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _jaxlib_include() -> str:
    """jaxlib's header directory, found without importing jax (import is slow, may fail)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("building lowbit's CPU kernels needs jaxlib installed (XLA FFI headers)")
    for location in spec.submodule_search_locations:
        include = os.path.join(location, "include")
        if os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            return include
    raise RuntimeError("jaxlib is installed but has no include/xla/ffi/api/ffi.h")


def _extensions() -> list[Extension]:
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(
        os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "lowbit/kernels/cpu/*.cc"))
    )
    # fp-contract=off: epilogues must round like the reference (mul, then add). GCC or Clang:
    # the per-ISA files rely on their target pragmas and builtins.
    args = ["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden"]
    return [
        Extension(
            "lowbit.kernels._cpu_kernels",
            sources=sources,
            include_dirs=[_jaxlib_include(), os.path.join(here, "lowbit/kernels/cpu")],
            depends=sorted(
                os.path.relpath(p, here)
                for p in glob.glob(os.path.join(here, "lowbit/kernels/cpu/*.h"))
            ),
            language="c++",
            extra_compile_args=args,
        )
    ]


class _ParallelBuildExt(build_ext):
    """Compiles the per-ISA translation units in parallel (they are independent)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


setup(ext_modules=_extensions(), cmdclass={"build_ext": _ParallelBuildExt})

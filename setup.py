"""Native CPU kernels of tokenmill, built by ``pip install`` (setuptools reads the rest from
pyproject.toml).

Every extension is optional: when the compiler is missing or a build fails, the install goes on
with a clear warning and tokenmill runs its pure-torch paths instead (each Python wrapper under
``tokenmill/_native`` says why its kernel is unavailable). The kernels are compiled for the
generic x86-64/aarch64 baseline; AVX2/FMA code paths are compiled with per-function target
attributes and chosen at run time from what the CPU reports, so one build runs everywhere.
"""
from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CFLAGS = ["-O3", "-std=c11", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
LDFLAGS = ["-fopenmp"]

HEADERS = ["src/tokenmill/_native/attention.h", "src/tokenmill/_native/quant.h"]  # rebuild triggers

NATIVE_MODULES = {
    # module name -> C sources (relative to this file)
    "tokenmill._native._attention": ["src/tokenmill/_native/attention.c"],
    "tokenmill._native._quant": ["src/tokenmill/_native/quant.c", "src/tokenmill/_native/decoder.c",
                                "src/tokenmill/_native/qgemm.c"],
    "tokenmill._native._sampling": ["src/tokenmill/_native/sampling.c"],
}


# extra flags per module. _quant: GCC's first scheduling pass, register-pressure aware. Its kernels
# unroll over a tile of activation rows; a stand-alone copy of the 4-row tile built without it
# hoisted a chunk's multiply-adds above their sums and spilled them to the stack. In the served
# kernels it made steps of 4 and 8 rows 3-6% faster, left one row level, and moved two rows
# between 2% faster and 6% slower
# (benchmarks/quant_verify_rows.py --baseline-so, one process; docs/benchmarks.md)
MODULE_CFLAGS = {"tokenmill._native._quant": ["-fschedule-insns", "-fsched-pressure"]}


class OptionalBuildExt(build_ext):
    """Build each native module if possible; warn and skip it otherwise."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # no compiler at all
            self._warn("all native kernels", e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            extra = MODULE_CFLAGS.get(ext.name, [])
            if extra:   # a compiler without the module's extra flags (clang has no -fsched-pressure)
                print(f"WARNING: {ext.name} failed with {' '.join(extra)} ({e}); building it without them",
                      file=sys.stderr)
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in extra]
                try:
                    super().build_extension(ext)
                    return
                except Exception as e2:
                    e = e2
            self._warn(ext.name, e)

    @staticmethod
    def _warn(what: str, err: Exception) -> None:
        print(f"WARNING: tokenmill could not build {what} ({err}); the pure-torch paths will be used",
              file=sys.stderr)


here = os.path.dirname(os.path.abspath(__file__))
setup(
    ext_modules=[Extension(name, sources, extra_compile_args=CFLAGS + MODULE_CFLAGS.get(name, []),
                           extra_link_args=LDFLAGS, depends=HEADERS)
                 for name, sources in NATIVE_MODULES.items()
                 if all(os.path.exists(os.path.join(here, s)) for s in sources)],
    cmdclass={"build_ext": OptionalBuildExt},
)

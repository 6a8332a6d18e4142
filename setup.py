"""Build script: maps the top-level kernel folders into the bitmtp namespace and builds the
optional native CPU extension.

* ``triton_kernels/`` installs as ``bitmtp.triton_kernels``, ``wgsl_fallback/`` as
  ``bitmtp.wgsl_fallback`` and the CUDA sources ``csrc/cuda/`` as ``bitmtp._csrc.cuda`` (they are
  compiled at run time through NVRTC, so users need no compiler).
* ``bitmtp._cpu_w2a8`` (csrc/cpu, pybind11 + OpenMP) is optional: if it fails to compile, the
  install still succeeds with a warning, and bitmtp runs on its pure-torch paths
  (``python -m bitmtp info`` says the ``cpu`` backend is missing and why). Set
  ``BITMTP_REQUIRE_CPU_EXT=1`` to make a failed build an error instead.

The extension is compiled for the baseline x86-64 target; its AVX2 and AVX-512 VNNI paths are
compiled per translation unit with ``#pragma GCC target`` and picked at run time from CPUID —
never ``-march=native``.
"""

from __future__ import annotations

import os
import sys
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PACKAGES = [
    "bitmtp",
    "bitmtp.formats",
    "bitmtp.ops",
    "bitmtp.ops.backends",
    "bitmtp.triton_kernels",
    "bitmtp.wgsl_fallback",
    "bitmtp.model",
    "bitmtp.runtime",
    "bitmtp.decoding",
    "bitmtp.train",
    "bitmtp._csrc.cuda",
]

PACKAGE_DIR = {
    "bitmtp": "bitmtp",
    "bitmtp.triton_kernels": "triton_kernels",
    "bitmtp.wgsl_fallback": "wgsl_fallback",
    "bitmtp._csrc.cuda": "csrc/cuda",
}


def _cpu_extension() -> list[Extension]:
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return []
    try:
        import pybind11
    except ImportError:
        print("bitmtp: pybind11 not available; skipping the native CPU extension", file=sys.stderr)
        return []
    return [
        Extension(
            "bitmtp._cpu_w2a8",
            sources=sorted(glob("csrc/cpu/*.cpp")),
            include_dirs=[pybind11.get_include(), "csrc/cpu"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"],
            extra_link_args=["-fopenmp"],
        )
    ]


class OptionalBuildExt(build_ext):
    """Build native extensions, but let the install succeed without them."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, headers missing, …
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc, ext.name)

    def _skip(self, exc: Exception, name: str = "native extensions") -> None:
        if os.environ.get("BITMTP_REQUIRE_CPU_EXT") == "1":
            raise exc
        print(f"bitmtp: WARNING: could not build {name} ({exc}); the package works without it "
              "on its pure-torch paths", file=sys.stderr)


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"bitmtp.wgsl_fallback": ["*.wgsl"], "bitmtp._csrc.cuda": ["*.cu", "*.cuh"],
                  # shipped MTP adapters (bitmtp/adapters/<name>/adapter_config.json + adapter.safetensors)
                  "bitmtp": ["adapters/*/*.json", "adapters/*/*.safetensors"]},
    ext_modules=_cpu_extension(),
    cmdclass={"build_ext": OptionalBuildExt},
)

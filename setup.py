"""Build script: maps the top-level kernel folders into the bitmtp namespace and builds the
optional native CPU extension.

* ``triton_kernels/`` installs as ``bitmtp.triton_kernels``, ``wgsl_fallback/`` as
  ``bitmtp.wgsl_fallback`` and the CUDA sources ``csrc/cuda/`` as ``bitmtp._csrc.cuda`` (they are
  compiled at run time through NVRTC, so users need no compiler).
* ``bitmtp._cpu_w2a8`` (csrc/cpu, pybind11, its own thread team: csrc/cpu/pool.h) is optional: if it
  fails to compile (no C++ compiler, no pybind11), the install still succeeds with a warning, and bitmtp
  runs on its pure-torch paths, several times slower on a CPU (the first use warns once; ``python -m
  bitmtp info`` says the ``cpu`` backend is missing and why). Set ``BITMTP_REQUIRE_CPU_EXT=1`` to make a
  skipped or failed build an error instead (CI does).
* The sdist carries every file the build reads (MANIFEST.in: the csrc headers and ``.inc`` fragments
  too); ``.ci/sdist_check.sh`` builds it, installs it in a fresh venv and imports the extension.
* The extension's translation units compile in parallel (``BITMTP_BUILD_JOBS``, default: all cores).

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
    "bitmtp.runtime.vulkan",
    "bitmtp.decoding",
    "bitmtp.train",
    "bitmtp.serve",
    "bitmtp._csrc.cuda",
]

PACKAGE_DIR = {
    "bitmtp": "bitmtp",
    "bitmtp.triton_kernels": "triton_kernels",
    "bitmtp.wgsl_fallback": "wgsl_fallback",
    "bitmtp._csrc.cuda": "csrc/cuda",
}


def _require() -> bool:
    return os.environ.get("BITMTP_REQUIRE_CPU_EXT") == "1"


def _cpu_extension() -> list[Extension]:
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        if _require():
            raise RuntimeError(f"BITMTP_REQUIRE_CPU_EXT=1: the native CPU extension builds on Linux and macOS, "
                               f"not {sys.platform}")
        return []
    try:
        import pybind11
        from pybind11.setup_helpers import ParallelCompile
    except ImportError:
        if _require():
            raise RuntimeError("BITMTP_REQUIRE_CPU_EXT=1 but pybind11 is not importable by the build: "
                               "pip install pybind11 (or build with isolation, which installs it)") from None
        print("bitmtp: WARNING: pybind11 not available; skipping the native CPU extension (bitmtp will run "
              "on its slower pure-torch paths)", file=sys.stderr)
        return []
    sources = sorted(glob("csrc/cpu/*.cpp"))
    if not sources and _require():
        raise RuntimeError("BITMTP_REQUIRE_CPU_EXT=1 but csrc/cpu/*.cpp is missing from this source tree")
    # one compiler process per translation unit, several at once (setuptools compiles them one by one)
    ParallelCompile("BITMTP_BUILD_JOBS", default=0).install()
    return [
        Extension(
            "bitmtp._cpu_w2a8",
            sources=sources,
            # headers and included fragments: rebuild when they change, and listed for the sdist
            depends=sorted(glob("csrc/cpu/*.h") + glob("csrc/cpu/*.inc")),
            include_dirs=[pybind11.get_include(), "csrc/cpu"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-pthread", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
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
        if _require():
            raise exc
        print(f"bitmtp: WARNING: could not build {name} ({exc}); the package works without it "
              "on its pure-torch paths, several times slower on a CPU (python -m bitmtp info says why)",
              file=sys.stderr)


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"bitmtp.wgsl_fallback": ["*.wgsl"], "bitmtp._csrc.cuda": ["*.cu", "*.cuh"],
                  # shipped MTP adapters (bitmtp/adapters/<name>/adapter_config.json + adapter.safetensors)
                  # and the prompt sets kept as data (bitmtp/data/: long documents, training and eval
                  # prompts) with the PSF license of the long documents' texts, which must travel with them
                  "bitmtp": ["adapters/*/*.json", "adapters/*/*.safetensors",
                             "data/*.json", "data/*.jsonl", "data/*.txt", "data/*.md",
                             "serve/static/*.html"]},
    ext_modules=_cpu_extension(),
    cmdclass={"build_ext": OptionalBuildExt},
)

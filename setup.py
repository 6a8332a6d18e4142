"""Build script: maps the top-level kernel folders into the bitmtp namespace.

``triton_kernels/`` installs as ``bitmtp.triton_kernels`` and ``wgsl_fallback/`` as
``bitmtp.wgsl_fallback``. Native extensions are optional: a failed compile leaves a package that
imports and runs on its pure-torch paths (``python -m bitmtp info`` says what is missing).
"""

from setuptools import setup

PACKAGES = [
    "bitmtp",
    "bitmtp.formats",
    "bitmtp.ops",
    "bitmtp.ops.backends",
    "bitmtp.triton_kernels",
    "bitmtp.wgsl_fallback",
]

PACKAGE_DIR = {
    "bitmtp": "bitmtp",
    "bitmtp.triton_kernels": "triton_kernels",
    "bitmtp.wgsl_fallback": "wgsl_fallback",
}

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"bitmtp.wgsl_fallback": ["*.wgsl"]},
)

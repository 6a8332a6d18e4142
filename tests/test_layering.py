"""Imports go one way: api → runtime/decoding → model → ops → kernels (DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {  # package prefix -> prefixes it must not import
    "bitmtp.formats": ("bitmtp.ops", "bitmtp.model", "bitmtp.runtime", "bitmtp.decoding", "bitmtp.api", "bitmtp.hf"),
    "bitmtp.ops": ("bitmtp.model", "bitmtp.runtime", "bitmtp.decoding", "bitmtp.api", "bitmtp.hf", "bitmtp.train"),
    "bitmtp.model": ("bitmtp.runtime", "bitmtp.decoding", "bitmtp.api", "bitmtp.hf", "bitmtp.train"),
    "bitmtp.runtime": ("bitmtp.api", "bitmtp.hf", "bitmtp.train"),
    "bitmtp.decoding": ("bitmtp.api", "bitmtp.hf", "bitmtp.train"),
    "bitmtp.triton_kernels": ("bitmtp.ops", "bitmtp.formats", "bitmtp.model", "bitmtp.runtime", "bitmtp.api"),
    "bitmtp.wgsl_fallback": ("bitmtp.ops", "bitmtp.model", "bitmtp.runtime", "bitmtp.api"),
}
FOLDERS = {"bitmtp.triton_kernels": ROOT / "triton_kernels", "bitmtp.wgsl_fallback": ROOT / "wgsl_fallback"}


def _module_files():
    for pkg, forbidden in LAYERS.items():
        folder = FOLDERS.get(pkg, ROOT / pkg.replace(".", "/"))
        for path in folder.rglob("*.py"):
            yield pkg, forbidden, path


def test_imports_go_one_way():
    bad = []
    for _pkg, forbidden, path in _module_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith(forbidden):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)

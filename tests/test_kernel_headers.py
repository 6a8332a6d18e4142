"""Every kernel file names its pure-torch reference and its test in its header (issue 22).

Kernel files: the native sources ``csrc/**`` (``.cpp``, ``.h``, ``.inc``, ``.cu``, ``.cuh``), the Triton
modules ``triton_kernels/*.py`` and every WGSL shader (``*.wgsl`` wherever it lives, so a move of the
shaders keeps them covered). The header is the leading ``//`` comment block of a C-like or WGSL file
and the module docstring of a Python file. It must hold, besides a description of what the file
computes, at least one line of each:

    Reference: bitmtp.pkg.module.function[, ...]   (an optional note in parentheses may follow)
    Test: tests/test_something.py[, ...]

A reference must import as ``module.attribute[.attribute]`` and be defined there (not re-exported);
a test path is resolved against the repository root (found by walking up to ``setup.py``, so this file
may move) and must be a file.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT  # found from setup.py, so it survives a move of tests (tests/support/paths.py)
SKIP_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__", ".ruff_cache", ".hypothesis"}
NATIVE_SUFFIXES = {".cpp", ".h", ".inc", ".cu", ".cuh"}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
REL_PATH = re.compile(r"[\w.-]+(/[\w.-]+)*")


def _walk(folder: Path):
    """Files under ``folder``, skipping virtualenvs, build output and caches."""
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if path.name not in SKIP_DIRS and not path.name.endswith(".egg-info"):
                yield from _walk(path)
        else:
            yield path


def kernel_files(root: Path = ROOT) -> list[Path]:
    """Every kernel file of the checkout at ``root``."""
    files = [p for p in _walk(root / "csrc") if p.suffix in NATIVE_SUFFIXES] if (root / "csrc").is_dir() else []
    files += sorted((root / "triton_kernels").glob("*.py"))
    files += [p for p in _walk(root) if p.suffix == ".wgsl"]
    return files


def header(path: Path) -> list[str]:
    """The header lines of a kernel file: its module docstring (Python) or leading ``//`` block."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text), clean=True)
        return doc.splitlines() if doc else []
    lines = []
    for line in text.splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[2:].strip())
    return lines


def _items(lines: list[str], key: str) -> list[str]:
    """The comma-separated items of every ``key: ...`` line; a note in parentheses after them is dropped."""
    out = []
    for line in lines:
        if line.startswith(key + ":"):
            value = line[len(key) + 1:].split(" (", 1)[0]
            out += [item.strip() for item in value.split(",")]
    return out


def resolve_reference(name: str) -> object:
    """``pkg.module.attr[.attr]`` → the object, imported from the longest importable module prefix.
    Raises LookupError naming what is missing."""
    if not DOTTED.fullmatch(name):
        raise LookupError(f"{name!r} is not a dotted module.function path")
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module_name.startswith(exc.name):
                raise  # the module exists but one of its own imports is missing: a real error
            continue
        for i in range(cut, len(parts)):
            if not hasattr(obj, parts[i]):
                raise LookupError(f"{'.'.join(parts[:i])} has no attribute {parts[i]!r}")
            obj = getattr(obj, parts[i])
        defined_in = getattr(inspect.unwrap(obj), "__module__", None)
        if defined_in != module_name:
            raise LookupError(f"{name} is defined in {defined_in}, not {module_name}: name the definition")
        return obj
    raise LookupError(f"no importable module in {name!r}")


def header_problems(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with ``path``'s header (empty when it names an existing reference and test)."""
    lines = header(path)
    rel = path.relative_to(root)
    refs, tests = _items(lines, "Reference"), _items(lines, "Test")
    prose = [line for line in lines if line and not line.startswith(("Reference:", "Test:"))]
    problems = []
    if not prose:
        problems.append(f"{rel}: the header does not say what the file computes")
    if not refs:
        problems.append(f"{rel}: no 'Reference: <module.function>' line in the header")
    if not tests:
        problems.append(f"{rel}: no 'Test: <tests/... file>' line in the header")
    for ref in refs:
        try:
            obj = resolve_reference(ref)
        except (LookupError, ImportError) as exc:
            problems.append(f"{rel}: Reference {ref}: {exc}")
            continue
        if not callable(obj):
            problems.append(f"{rel}: Reference {ref} is not a function or class")
    for test in tests:
        if not REL_PATH.fullmatch(test) or ".." in test.split("/"):
            problems.append(f"{rel}: Test {test!r} is not a path relative to the repository root")
        elif not (root / test).is_file():
            problems.append(f"{rel}: Test {test} does not exist (paths are relative to {root})")
    return problems


def test_kernel_files_are_found():
    """Each kind of kernel file is present, so the header check below cannot pass on an empty list."""
    suffixes = {p.suffix for p in kernel_files()}
    assert {".cpp", ".h", ".inc", ".cu", ".cuh", ".py", ".wgsl"} <= suffixes, suffixes


@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernel_header_names_reference_and_test(path):
    problems = header_problems(path)
    assert not problems, "\n".join(problems)


# ---- the checker itself fails on broken headers ------------------------------------------------------------

GOOD_REF = "bitmtp.ops.reference.attention_reference"


@pytest.mark.parametrize("suffix,text,expect", [
    (".cpp", "// Attention.\n#include <x>\n", "no 'Reference"),
    (".wgsl", f"// Attention.\n// Reference: {GOOD_REF}\n\nfn main() {{}}\n", "no 'Test"),
    (".cu", f"// Reference: {GOOD_REF}\n// Test: tests/t.py\n", "does not say what"),
    (".cuh", "// W2A8.\n// Reference: bitmtp.ops.reference.no_such_reference\n// Test: tests/t.py\n",
     "has no attribute 'no_such_reference'"),
    (".h", "// W2A8.\n// Reference: bitmtp.no_such_module.f\n// Test: tests/t.py\n", "has no attribute"),
    (".inc", "// Dense.\n// Reference: bitmtp.ops.dense_linear\n// Test: tests/t.py\n", "name the definition"),
    (".inc", "// Dense.\n// Reference: bitmtp.ops.reference.F\n// Test: tests/t.py\n", "name the definition"),
    (".cpp", "// Dense.\n// Reference: dense_linear_reference\n// Test: tests/t.py\n", "not a dotted"),
    (".cpp", f"// Dense.\n// Reference: {GOOD_REF}\n// Test: tests/missing.py\n", "does not exist"),
    (".cpp", f"// Dense.\n// Reference: {GOOD_REF}\n// Test: ../outside.py\n", "not a path relative"),
    (".cpp", f"// Dense.\n\n// Reference: {GOOD_REF}\n// Test: tests/t.py\n", "no 'Reference"),  # not in the header
    (".py", f'"""Attention."""\n# Reference: {GOOD_REF}\n# Test: tests/t.py\n', "no 'Reference"),
])
def test_checker_rejects_broken_headers(tmp_path, suffix, text, expect):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("")
    path = tmp_path / f"kernel{suffix}"
    path.write_text(text)
    problems = header_problems(path, tmp_path)
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("suffix,text", [
    (".cpp", f"// Attention.\n//\n// Reference: {GOOD_REF} (a note)\n// Test: tests/t.py, tests/t.py\n#include <x>\n"),
    (".py", f'"""Attention.\n\nReference: {GOOD_REF}, bitmtp.runtime.kv.KVStore.write\nTest: tests/t.py\n"""\n'),
])
def test_checker_accepts_good_headers(tmp_path, suffix, text):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("")
    path = tmp_path / f"kernel{suffix}"
    path.write_text(text)
    assert header_problems(path, tmp_path) == []

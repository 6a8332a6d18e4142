"""tests/ mirrors the source tree, and test modules share code only through tests/support/ (issue 22).

Rules, checked on the checkout and (so each check is seen failing) on small fake trees:

* A test file ``tests/<path>/test_*.py`` sits in a folder that mirrors a source package: ``bitmtp/<path>/``
  (a folder with ``__init__.py``) or a folder that setup.py's ``PACKAGE_DIR`` maps into the ``bitmtp``
  namespace (``triton_kernels/`` → ``tests/triton_kernels/``, ``wgsl_fallback/`` → ``tests/wgsl_fallback/``).
  A top-level ``tests/test_<name>.py`` tests a top-level module ``bitmtp/<m>.py`` (``<name>`` is ``<m>`` or
  starts with ``<m>_``: test_api_inputs.py, test_cli_errors.py) or the repository as a whole
  (:data:`REPO_WIDE`: packaging, layering, this layout, kernel headers, the benchmark gate and the peer
  benchmark's harness, the golden tokens).
* Every folder of tests/ holding Python files has an ``__init__.py`` (tests import as the ``tests`` package,
  so two folders may hold test files of the same name).
* Outside tests/support/, tests/ holds only test files, ``__init__.py`` and ``conftest.py`` (fixtures).
* No module under tests/, bench/ or scripts/ imports a module of tests/ other than ``tests.support.*``:
  import statements anywhere in a file (function-local ones too), relative imports, and code in string
  literals run by a child process (``from tests.x import y`` inside a string) all count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

#: Top-level test files about the repository as a whole rather than one module (golden_tokens: every
#: policy's tokens on the real model against tests/golden/, end to end; bench_peer: bench/'s llama.cpp harness;
#: mutants_apply: scripts/mutate.py's mutants still apply to the source; bench_chat_drafts: bench/'s GPU
#: distil-and-train driver; bench_glue / bench_plots: bench/'s host-glue timer and plots; readme: the README's code
#: runs and its results table is BENCHMARKS.md's summary; docs: the documents' lengths and links).
REPO_WIDE = {"packaging", "layering", "layout", "kernel_headers", "bench_gate", "bench_peer", "bench_ternary_peer",
             "golden_tokens", "mutants_apply", "bench_chat_drafts", "bench_glue", "bench_plots", "readme", "docs"}

#: Folders whose modules may not import test modules (bench/ and scripts/ use tests.support too).
CHECKED_FOLDERS = ("tests", "bench", "scripts")
SKIP_DIRS = {"__pycache__", ".hypothesis", ".pytest_cache", "out"}
CODE_IN_STRING = re.compile(r"(?:^|\s)(?:from\s+(tests(?:\.\w+)*)\s+import\s|import\s+(tests(?:\.\w+)*)(?=[\s,;]|$))")


def _python_files(folder: Path):
    """``.py`` files under ``folder``, skipping caches and benchmark output."""
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if path.name not in SKIP_DIRS:
                yield from _python_files(path)
        elif path.suffix == ".py":
            yield path


def _package_dir(root: Path) -> dict[str, str]:
    """setup.py's ``PACKAGE_DIR``: package name → folder relative to the root."""
    tree = ast.parse((root / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{root / 'setup.py'} defines no PACKAGE_DIR")


def source_folders(root: Path) -> set[tuple[str, ...]]:
    """The package paths a test folder may mirror, below ``bitmtp``: ``("ops", "backends")`` for
    bitmtp/ops/backends/, ``("wgsl_fallback",)`` for the folder mapped to ``bitmtp.wgsl_fallback``."""
    out: set[tuple[str, ...]] = set()
    for package, folder in _package_dir(root).items():
        prefix = tuple(package.split(".")[1:])
        if prefix:
            out.add(prefix)  # a mapped folder is a package by setup.py, with or without __init__.py
        base = root / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            if rel and "__pycache__" not in rel:
                out.add(prefix + rel)
    return out


def top_level_modules(root: Path) -> set[str]:
    """Names of the modules directly in bitmtp/ (api, cli, errors, ...)."""
    return {p.stem for p in (root / "bitmtp").glob("*.py") if p.stem != "__init__"}


def placement_problem(rel: str, root: Path = REPO_ROOT) -> str | None:
    """Why the test file at ``rel`` (``tests/...``, posix) is misplaced, or None when it mirrors its code."""
    parts = Path(rel).parts
    folder, name = parts[1:-1], parts[-1]
    if not folder:
        stem = name[len("test_"):-len(".py")]
        modules = top_level_modules(root)
        if stem in REPO_WIDE or any(stem == m or stem.startswith(m + "_") for m in modules):
            return None
        return (f"{rel}: no top-level module bitmtp/<m>.py for it (its name must be test_<m>[_...].py, one of "
                f"{sorted(modules)}): move it to tests/<package>/ beside the code it tests")
    if folder in source_folders(root):
        return None
    return (f"{rel}: tests/{'/'.join(folder)}/ mirrors no source package (bitmtp/{'/'.join(folder)}/ or a folder "
            f"of setup.py's PACKAGE_DIR): move it to the tests/ folder of the code it tests")


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("").parts
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _imported_modules(path: Path, root: Path) -> list[tuple[str, int]]:
    """``(module, line)`` of every module of the ``tests`` package that ``path`` imports or names in
    importing code inside a string literal."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = _module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # ``from tests.x import y`` loads the module tests.x.y when there is one
                sub = root.joinpath(*base.split("."), alias.name)
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
                found.append((f"{base}.{alias.name}" if is_module else base, node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(a or b, node.lineno) for a, b in CODE_IN_STRING.findall(node.value)]
    return [(m, line) for m, line in found if m == "tests" or m.startswith("tests.")]


def import_problems(root: Path = REPO_ROOT) -> list[str]:
    """Imports of test modules (anything under tests/ but tests.support) by tests/, bench/ and scripts/."""
    problems = []
    for top in CHECKED_FOLDERS:
        if not (root / top).is_dir():
            continue
        for path in _python_files(root / top):
            rel = path.relative_to(root).as_posix()
            for module, line in _imported_modules(path, root):
                if module != "tests.support" and not module.startswith("tests.support."):
                    problems.append(f"{rel}:{line} imports {module}: only tests.support.* may be imported; move "
                                    f"what it uses to tests/support/ (fixtures: a conftest.py)")
    return problems


def tree_problems(root: Path = REPO_ROOT) -> list[str]:
    """Misplaced test files, helper modules outside tests/support/ and folders without ``__init__.py``."""
    tests = root / "tests"
    problems = []
    for path in _python_files(tests):
        rel = path.relative_to(root).as_posix()
        in_support = tests / "support" in path.parents
        if path.name.startswith("test_") and not in_support:
            problem = placement_problem(rel, root)
            if problem:
                problems.append(problem)
        elif path.name not in ("__init__.py", "conftest.py") and not in_support:
            problems.append(f"{rel}: a helper module outside tests/support/: move it there (fixtures: conftest.py)")
        elif path.name.startswith("test_"):
            problems.append(f"{rel}: a test file inside tests/support/: move it beside the code it tests")
    folders = {p.parent for p in _python_files(tests)}
    for folder in sorted(folders):
        if not (folder / "__init__.py").is_file():
            problems.append(f"{folder.relative_to(root).as_posix()}/ has no __init__.py: add an empty one "
                            f"(tests import as the tests package)")
    return problems


# ---- the checkout -------------------------------------------------------------------------------------------

def test_no_test_module_imports_another():
    problems = import_problems()
    assert not problems, "\n".join(problems)


def test_tests_mirror_the_source_tree():
    problems = tree_problems()
    assert not problems, "\n".join(problems)


def test_the_walk_sees_the_tree():
    """The checks above look at the test files that exist (a walk of the wrong folder would pass them)."""
    found = {p.relative_to(REPO_ROOT).as_posix() for p in _python_files(REPO_ROOT / "tests")}
    assert {"tests/test_layout.py", "tests/ops/test_w2a8_linear.py", "tests/support/hf_models.py",
            "tests/runtime/vulkan/test_runtime.py"} <= found
    assert ("ops", "backends") in source_folders(REPO_ROOT) and ("wgsl_fallback",) in source_folders(REPO_ROOT)


# ---- the checker itself -------------------------------------------------------------------------------------

GOOD_TREE = {
    "setup.py": 'PACKAGE_DIR = {"bitmtp": "bitmtp", "bitmtp.kern": "kern"}\n',
    "bitmtp/__init__.py": "", "bitmtp/api.py": "", "bitmtp/cli_train.py": "",
    "bitmtp/ops/__init__.py": "", "bitmtp/ops/backends/__init__.py": "", "bitmtp/adapters/data.json": "",
    "kern/k.py": "",  # a mapped folder without __init__.py is a package all the same
    "tests/__init__.py": "", "tests/conftest.py": "", "tests/support/__init__.py": "",
    "tests/support/helpers.py": "from tests.support import other\n", "tests/support/other.py": "",
    "tests/test_api.py": "from tests.support.helpers import f\n", "tests/test_api_inputs.py": "",
    "tests/test_cli_train.py": "", "tests/test_layout.py": "",
    "tests/ops/__init__.py": "", "tests/ops/conftest.py": "",
    "tests/ops/test_x.py": "from tests.support import helpers\nfrom ..support.helpers import f\n",
    "tests/ops/backends/__init__.py": "", "tests/ops/backends/test_y.py": "import tests.support.helpers\n",
    "tests/kern/__init__.py": "", "tests/kern/test_k.py": 'CHILD = "from tests.support.helpers import f"\n',
    "bench/__init__.py": "", "bench/b.py": "from tests.support.helpers import f\n",
    "scripts/s.py": "def main():\n    from tests.support.helpers import f\n",
}


def _write(root: Path, files: dict[str, str | None]) -> None:
    for rel, text in files.items():
        path = root / rel
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def test_checker_accepts_a_good_tree(tmp_path):
    _write(tmp_path, GOOD_TREE)
    assert import_problems(tmp_path) == [] and tree_problems(tmp_path) == []


#: "@" stands for "tests" (written out, these strings would be imports of test modules in this very file)
BAD_IMPORTS = [
    ("tests/ops/test_z.py", "from @.ops.test_x import f\n", "tests/ops/test_z.py:1 imports tests.ops.test_x"),
    ("tests/ops/test_z.py", "from @.ops import test_x\n", "imports tests.ops.test_x"),
    ("tests/ops/test_z.py", "import @.ops.test_x\n", "imports tests.ops.test_x"),
    ("tests/ops/test_z.py", "from .test_x import f\n", "imports tests.ops.test_x"),
    ("tests/ops/test_z.py", "from . import test_x\n", "imports tests.ops.test_x"),
    ("tests/ops/test_z.py", "\n\ndef t():\n    from @.conftest import g\n", "test_z.py:4 imports tests.conftest"),
    ("tests/ops/test_z.py", 'CHILD = """\nimport sys\nfrom @.ops.test_x import f\n"""\n', "tests.ops.test_x"),
    ("tests/support/helpers.py", "from @.test_api import f\n", "tests/support/helpers.py:1 imports tests.test_api"),
    ("bench/b.py", "from @.kern.test_k import CHILD\n", "bench/b.py:1 imports tests.kern.test_k"),
    ("scripts/s.py", "import @\n", "scripts/s.py:1 imports tests:"),
]


@pytest.mark.parametrize("rel,text,expect", BAD_IMPORTS)
def test_checker_rejects_imports_of_test_modules(tmp_path, rel, text, expect):
    _write(tmp_path, GOOD_TREE)
    _write(tmp_path, {rel: text.replace("@", "tests")})
    problems = import_problems(tmp_path)
    assert any(expect in p and "tests/support/" in p for p in problems), problems


BAD_TREES = [
    ({"tests/test_ops.py": ""}, "tests/test_ops.py: no top-level module"),  # ops is a package, not a module
    ({"tests/test_apix.py": ""}, "tests/test_apix.py: no top-level module"),
    ({"tests/model/__init__.py": "", "tests/model/test_m.py": ""},
     "tests/model/test_m.py: tests/model/ mirrors no source package"),
    ({"tests/ops/kern/__init__.py": "", "tests/ops/kern/test_k.py": ""},  # kern mirrors kern/, not bitmtp/ops/kern/
     "tests/ops/kern/test_k.py: tests/ops/kern/ mirrors no source package"),
    ({"tests/adapters/__init__.py": "", "tests/adapters/test_a.py": ""},  # bitmtp/adapters/ holds data, no package
     "tests/adapters/test_a.py: tests/adapters/ mirrors no source package"),
    ({"tests/ops/backends/__init__.py": None}, "tests/ops/backends/ has no __init__.py"),
    ({"tests/ops/helpers.py": ""}, "tests/ops/helpers.py: a helper module outside tests/support/"),
    ({"tests/hf_models.py": ""}, "tests/hf_models.py: a helper module outside tests/support/"),
    ({"tests/support/test_s.py": ""}, "tests/support/test_s.py: a test file inside tests/support/"),
]


@pytest.mark.parametrize("files,expect", BAD_TREES)
def test_checker_rejects_misplaced_files(tmp_path, files, expect):
    _write(tmp_path, GOOD_TREE)
    _write(tmp_path, files)
    problems = tree_problems(tmp_path)
    assert any(p.startswith(expect) for p in problems), problems




def test_the_design_document_lives_in_the_repository():
    """The design the code follows is docs/DESIGN.md, and no document or module points outside the repository
    for it (``../shared/`` exists only beside a development checkout)."""
    assert (REPO_ROOT / "docs" / "DESIGN.md").read_text().startswith("#")
    outside = [f"{p.relative_to(REPO_ROOT)}:{n}" for pattern in ("*.md", "bitmtp/**/*.py", "docs/*.md")
               for p in REPO_ROOT.glob(pattern) for n, line in enumerate(p.read_text().splitlines(), 1)
               if "../shared/" in line]
    assert not outside, f"these point at ../shared/ (outside the repository): {outside}"


def test_package_text_carries_no_development_history():
    """Docstrings and shipped files say what the code does now: no "session N" under bitmtp/ (the history of
    measurements lives in BENCHMARKS.md)."""
    pat = re.compile(r"\bsessions? \d", re.IGNORECASE)
    hits = [f"{p.relative_to(REPO_ROOT)}:{n}" for p in (REPO_ROOT / "bitmtp").rglob("*")
            if p.is_file() and p.suffix in {".py", ".json", ".md", ".txt", ".wgsl", ".jsonl"}
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pat.search(line)]
    assert not hits, f"development history in package text: {hits}"

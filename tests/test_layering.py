"""Imports go one way and never in a circle (DESIGN.md: api → runtime/decoding → model → ops → kernels).

Every module of the package is covered: the files under ``bitmtp/`` and the folders that setup.py's
``PACKAGE_DIR`` maps into the ``bitmtp`` namespace (``triton_kernels/`` → ``bitmtp.triton_kernels``,
...). Modules are discovered by walking those folders, so moving or adding a module needs no change
here — only a new top-level place needs a layer in :data:`LAYERS`.

An import is every ``import`` / ``from ... import`` statement anywhere in a file (function-local ones
included) and every ``importlib.import_module("literal")``, resolved to the module it loads:
``from bitmtp.x import y`` is an import of ``bitmtp.x.y`` when that is a module, else of ``bitmtp.x``;
relative imports resolve against the importing module's package. Importing ``bitmtp.x.y`` is not
counted as importing ``bitmtp`` or ``bitmtp.x`` (their ``__init__`` run, but they re-export their
children; counting them would turn every child → parent edge into a cycle).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT  # found from setup.py, so it survives a move of tests (tests/support/paths.py)

#: Layers from the bottom up. A module may import modules of its own layer or of a layer below it,
#: never above. A module belongs to the layer of its longest matching prefix (``"bitmtp"`` matches the
#: package's own ``__init__`` only).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("bitmtp.errors",)),
    # the kernel layer imports only torch / triton / wgpu (and bitmtp.errors); csrc/cuda ships as data
    ("kernels", ("bitmtp.triton_kernels", "bitmtp.wgsl_fallback", "bitmtp._csrc")),
    ("formats", ("bitmtp.formats",)),  # pure tensor and file formats
    ("ops", ("bitmtp.ops",)),
    ("model", ("bitmtp.model",)),
    # shipped-adapter lookup (formats only): used by the api and the CLI, never the other way
    # (the Vulkan runtime's VRAM planner lives in bitmtp.runtime.vulkan.planner)
    ("planning", ("bitmtp.shipped",)),
    ("runtime", ("bitmtp.runtime", "bitmtp.decoding")),
    ("api", ("bitmtp.api",)),
    ("hf", ("bitmtp.hf",)),  # bitmtp.patch: wraps the api for transformers models
    ("facade", ("bitmtp",)),  # bitmtp/__init__.py: re-exports ops, api (load, generate) and hf (patch)
    ("train", ("bitmtp.train",)),  # trains adapters; evaluates through bitmtp.generate
    ("serve", ("bitmtp.serve",)),  # the OpenAI-compatible server and its Ray Serve deployment, over bitmtp.generate
    ("cli", ("bitmtp.cli", "bitmtp.cli_common", "bitmtp.cli_presets", "bitmtp.cli_train", "bitmtp.cli_convert",
             "bitmtp.cli_serve", "bitmtp.__main__")),
]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # path:line of the import statement


def _setup_constants(root: Path) -> tuple[dict[str, str], set[str]]:
    """setup.py's ``PACKAGE_DIR`` (package → folder) and the names of its native extensions."""
    tree = ast.parse((root / "setup.py").read_text(encoding="utf-8"))
    package_dir: dict[str, str] = {}
    natives: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets):
            package_dir = ast.literal_eval(node.value)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension" and node.args
              and isinstance(node.args[0], ast.Constant)):
            natives.add(node.args[0].value)
    return package_dir, natives


def discover_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every Python module of the ``bitmtp`` namespace in the checkout at ``root``: name → file."""
    package_dir, _ = _setup_constants(root)
    folders = {"bitmtp": "bitmtp", **package_dir}
    modules: dict[str, Path] = {}
    for package, folder in folders.items():  # "bitmtp" first: a mapped folder overrides bitmtp/<name>/
        base = root / folder
        assert base.is_dir(), f"setup.py maps {package} to {folder}/, which does not exist"
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if "__pycache__" in rel.parts:
                continue
            parts = package.split(".") + list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for package, folder in package_dir.items():  # what installs under a mapped name is that folder only
        if package == "bitmtp":
            continue
        for name in [n for n in modules if n == package or n.startswith(package + ".")]:
            if not modules[name].is_relative_to(root / folder):
                del modules[name]
    return modules


def import_edges(modules: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    """Every import between ``modules`` (see the module docstring for what counts)."""
    _, natives = _setup_constants(root)
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    if child in modules or child in natives:
                        targets.append(child)
                    else:
                        targets.append(source)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and getattr(node.func.value, "id", None) == "importlib"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [node.args[0].value]
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
            for target in targets:
                if target in modules and target != name:
                    edges.append(Edge(name, target, where))
    return edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle per strongly connected component of the import graph that has one."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    # Tarjan's strongly connected components, iteratively (no recursion limit on deep graphs)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    cycles = []
    for component in components:
        members = set(component)
        if len(members) == 1:
            continue  # self-imports are dropped in import_edges
        first = min(members)
        # breadth-first from `first` back to `first` inside the component: a shortest cycle
        parent: dict[str, Edge] = {}
        queue = deque([first])
        while queue:
            node = queue.popleft()
            hit = graph[node].get(first)
            if hit is not None:
                path = [hit]
                while path[0].source != first:
                    path.insert(0, parent[path[0].source])
                cycles.append(path)
                break
            for child, edge in sorted(graph[node].items()):
                if child in members and child not in parent and child != first:
                    parent[child] = edge
                    queue.append(child)
    return cycles


def describe(cycle: list[Edge]) -> str:
    """``a → b → a`` plus where each import is."""
    chain = " → ".join([cycle[0].source] + [e.target for e in cycle])
    return chain + "\n" + "\n".join(f"    {e.source} imports {e.target} at {e.where}" for e in cycle)


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the layer ``module`` belongs to (longest matching prefix)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix == "bitmtp"
            if module == prefix or (not exact_only and module.startswith(prefix + ".")):
                if len(prefix) > best_len:
                    best, best_len = i, len(prefix)
    return best


def layer_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = layer_of(e.source), layer_of(e.target)
        if src is not None and dst is not None and dst > src:
            bad.append(f"{e.where}: {e.source} ({LAYERS[src][0]}) imports {e.target} ({LAYERS[dst][0]}), "
                       f"a higher layer")
    return bad


MODULES = discover_modules()
EDGES = import_edges(MODULES)


def test_every_module_is_covered():
    """The walk finds the package's main modules and every Python file of the folders setup.py maps
    into the namespace, and each module sits in a layer."""
    for must in ("bitmtp", "bitmtp.api", "bitmtp.hf", "bitmtp.cli", "bitmtp.cli_common", "bitmtp.cli_train",
                 "bitmtp.errors", "bitmtp.train.trainer", "bitmtp.triton_kernels", "bitmtp.triton_kernels.w2a8",
                 "bitmtp.ops.reference", "bitmtp.model.decoder"):
        assert must in MODULES, f"{must} not discovered"
    package_dir, _ = _setup_constants(ROOT)
    files = {p for folder in {"bitmtp", *package_dir.values()} for p in (ROOT / folder).rglob("*.py")
             if "__pycache__" not in p.parts}
    assert set(MODULES.values()) == files, sorted(map(str, files ^ set(MODULES.values())))
    unplaced = [m for m in MODULES if layer_of(m) is None]
    assert not unplaced, f"place these modules in a layer of tests/test_layering.py LAYERS: {unplaced}"


def test_imports_go_one_way():
    bad = layer_violations(EDGES)
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = find_cycles(EDGES)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c) for c in cycles)


def test_kernel_layer_imports_no_other_bitmtp_layer():
    """``bitmtp.triton_kernels`` imports only torch and triton; the WGSL runner only wgpu (and errors)."""
    kernels = LAYERS.index(next(layer for layer in LAYERS if layer[0] == "kernels"))
    bad = [f"{e.where}: {e.source} imports {e.target}" for e in EDGES
           if (layer_of(e.source) == kernels and layer_of(e.target) not in (kernels, 0))
           or (e.source.startswith("bitmtp.triton_kernels") and not e.target.startswith("bitmtp.triton_kernels"))]
    assert not bad, "\n".join(bad)


# ---- the checker itself: a fake checkout ----------------------------------------------------------------

def _fake_checkout(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "setup.py").write_text('PACKAGE_DIR = {"bitmtp": "bitmtp", "bitmtp.kern": "kern"}\n'
                                       'Extension("bitmtp._native", sources=[])\n')
    for rel, text in {"bitmtp/__init__.py": "", "kern/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _cycles(tmp_path: Path, files: dict[str, str]) -> list[str]:
    root = _fake_checkout(tmp_path, files)
    return [describe(c) for c in find_cycles(import_edges(discover_modules(root), root))]


@pytest.mark.parametrize("files,chain", [
    # plain top-level imports
    ({"bitmtp/a.py": "import bitmtp.b\n", "bitmtp/b.py": "from bitmtp.a import f\n"}, "bitmtp.a → bitmtp.b → bitmtp.a"),
    # a function-local import closes the cycle
    ({"bitmtp/a.py": "from bitmtp.b import g\n", "bitmtp/b.py": "def g():\n    from bitmtp import a\n"},
     "bitmtp.a → bitmtp.b → bitmtp.a"),
    # `from package import submodule` counts as importing the submodule; relative imports resolve
    ({"bitmtp/p/__init__.py": "", "bitmtp/p/x.py": "from . import y\n", "bitmtp/p/y.py": "from ..p import x\n"},
     "bitmtp.p.x → bitmtp.p.y → bitmtp.p.x"),
    # a folder mapped by PACKAGE_DIR (kern/ installs as bitmtp.kern), three modules long
    ({"bitmtp/a.py": "import bitmtp.kern.k\n", "kern/k.py": "from bitmtp.c import h\n",
      "bitmtp/c.py": "import importlib\ndef h():\n    importlib.import_module('bitmtp.a')\n"},
     "bitmtp.a → bitmtp.kern.k → bitmtp.c → bitmtp.a"),
    # the package's own __init__ (a lazy re-export) against a module that imports the package
    ({"bitmtp/__init__.py": "def __getattr__(n):\n    from bitmtp import a\n", "bitmtp/a.py": "import bitmtp\n"},
     "bitmtp → bitmtp.a → bitmtp"),
])
def test_cycle_finder_finds_planted_cycles(tmp_path, files, chain):
    found = _cycles(tmp_path, files)
    assert len(found) == 1 and found[0].startswith(chain + "\n"), found


@pytest.mark.parametrize("files", [
    # a child importing its parent package's attribute, the parent re-exporting the child: no cycle
    {"bitmtp/p/__init__.py": "from bitmtp.p.x import f\n", "bitmtp/p/x.py": "from bitmtp.errors import E\n",
     "bitmtp/errors.py": ""},
    # the native extension is a leaf, not an import of the package
    {"bitmtp/__init__.py": "from bitmtp.a import f\n", "bitmtp/a.py": "from bitmtp import _native\n"},
    # a one-way chain
    {"bitmtp/a.py": "import bitmtp.b\n", "bitmtp/b.py": "def f():\n    import bitmtp.c\n", "bitmtp/c.py": ""},
])
def test_cycle_finder_passes_acyclic_code(tmp_path, files):
    assert _cycles(tmp_path, files) == []


def test_layer_rule_catches_an_upward_import():
    edges = [Edge("bitmtp.ops.linear", "bitmtp.runtime.engine", "bitmtp/ops/linear.py:3"),
             Edge("bitmtp.runtime.engine", "bitmtp.ops.linear", "bitmtp/runtime/engine.py:9"),
             Edge("bitmtp.hf", "bitmtp", "bitmtp/hf.py:76")]
    bad = layer_violations(edges)
    assert len(bad) == 2 and "bitmtp.ops.linear (ops) imports bitmtp.runtime.engine (runtime)" in bad[0], bad
    assert "bitmtp.hf (hf) imports bitmtp (facade)" in bad[1], bad

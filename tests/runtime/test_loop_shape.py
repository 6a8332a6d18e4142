"""The decode steps read on one screen (issue 45, "The loop"): ``runtime/decode.py``'s one-pass step function and
``runtime/batch.py``'s batched step, each with every function and method it calls of its module and of
``DecodeStats`` (the stats it records; helpers included, transitively), are at most 60 lines of code and 10
branches. Not counted, as objects with jobs of their own: the layouts of ``runtime/pass_layouts.py`` (what differs
between kinds of step), the planners (``decoding/``), the output's stop rules (``runtime/output.py::Output.add``,
shared by every loop and the batch engine), and for the batch the objects a solo step has in its engine and
runner: who runs (``runtime/batch_schedule.py``), the forward pass and its read (``runtime/batch_pass.py``) and a
sequence's own commit (``runtime/batch_seq.py``)."""

from __future__ import annotations

import ast

import pytest

from tests.support.paths import REPO_ROOT

DECODE = REPO_ROOT / "bitmtp" / "runtime" / "decode.py"
BATCH = REPO_ROOT / "bitmtp" / "runtime" / "batch.py"
OUTPUT = REPO_ROOT / "bitmtp" / "runtime" / "output.py"
MAX_LINES = 60
MAX_BRANCHES = 10
BRANCHES = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.Match, ast.comprehension)


def _defs(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    """Every function and method of the module by name (a method's name alone: calls name it so)."""
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def _called(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def _code_lines(fn: ast.FunctionDef, source: list[str]) -> int:
    """Lines of code of ``fn``: its lines without its docstring, blank lines and comment-only lines."""
    body = fn.body
    skip = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i in range(fn.lineno, fn.end_lineno + 1)
               if i not in skip and source[i - 1].strip() and not source[i - 1].strip().startswith("#"))


def _step_and_helpers(name: str = "_pass_step", module=DECODE) -> list[tuple[ast.FunctionDef, list[str]]]:
    """The step function ``name`` of ``module`` and its helpers, each with its module's source lines."""
    defs, lines = {}, {}
    out = OUTPUT.read_text()
    stats = next(n for n in ast.parse(out).body if isinstance(n, ast.ClassDef) and n.name == "DecodeStats")
    for fname, fn in _defs(stats).items():
        defs[fname], lines[fname] = fn, out.splitlines()
    text = module.read_text()
    for fname, fn in _defs(ast.parse(text)).items():
        defs[fname], lines[fname] = fn, text.splitlines()
    seen, todo = [], [defs[name]]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.append(fn)
        todo += [defs[c] for c in _called(fn) if c in defs]
    return [(fn, lines[fn.name]) for fn in seen]


def test_the_one_pass_step_reads_on_one_screen():
    fns = _step_and_helpers()
    names = sorted(f.name for f, _ in fns)
    lines = sum(_code_lines(f, source) for f, source in fns)
    branches = sum(isinstance(node, BRANCHES) for f, _ in fns for node in ast.walk(f))
    assert {"_pass_step", "record_pass", "_count_positions"} <= set(names)  # the stats it records count too
    assert lines <= MAX_LINES, f"{names}: {lines} lines of code"
    assert branches <= MAX_BRANCHES, f"{names}: {branches} branches"


def test_the_batched_step_reads_on_one_screen():
    """``BatchEngine.step`` — schedule, lay out, ONE pass, ONE read, accept, commit per sequence — with its
    helpers (it was 123 lines and 28 branches with the forward plumbing, admission and finishing inline)."""
    fns = _step_and_helpers("step", BATCH)
    names = sorted(f.name for f, _ in fns)
    lines = sum(_code_lines(f, source) for f, source in fns)
    branches = sum(isinstance(node, BRANCHES) for f, _ in fns for node in ast.walk(f))
    assert {"step", "_run_step", "_commit_group", "_commit", "record_batch_step"} <= set(names)
    assert lines <= MAX_LINES, f"{names}: {lines} lines of code"
    assert branches <= MAX_BRANCHES, f"{names}: {branches} branches"


def test_the_measure_counts_what_it_says():
    """The counter itself: a made-up step with a helper that branches is counted whole."""
    code = ("def step(x):\n    '''doc\n    string'''\n    # a comment\n    if x:\n        return helper(x)\n"
            "    return 0\n\n\ndef helper(y):\n    return [z for z in y if z] if y else None\n")
    tree = ast.parse(code)
    defs = _defs(tree)
    assert _called(defs["step"]) == {"helper"}
    lines = code.splitlines()
    assert _code_lines(defs["step"], lines) == 4 and _code_lines(defs["helper"], lines) == 2
    assert sum(isinstance(n, BRANCHES) for n in ast.walk(tree)) == 3


@pytest.mark.parametrize("kind", ["PlainPass", "MaskPass", "TreePass"])
def test_every_kind_of_step_is_a_layout(kind):
    from bitmtp.runtime import pass_layouts

    cls = getattr(pass_layouts, kind)
    for method in ("runner", "read", "observe", "runner_up", "committed", "advance", "hand_on", "choice"):
        assert callable(getattr(cls, method))

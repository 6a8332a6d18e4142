"""The mutation list stays applicable: every mutant's snippet occurs exactly once in its file.

``scripts/mutate.py`` counts a stale mutant as a failure, but only when CI runs the whole mutation check
(minutes). This test finds a stale snippet in well under a second, in the ordinary suite, so a refactor
that moves the mutated code fails where the person refactoring sees it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutate_module():
    spec = importlib.util.spec_from_file_location("bitmtp_mutate_script", ROOT / "scripts" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


MUTATE = _mutate_module()


@pytest.mark.parametrize("mutant", MUTATE.MUTANTS, ids=lambda m: m.name)
def test_mutant_snippet_occurs_exactly_once(mutant, tmp_path):
    src = ROOT / mutant.file
    assert src.is_file(), f"{mutant.name}: {mutant.file} does not exist"
    dst = tmp_path / mutant.file
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(src.read_text())
    used = MUTATE.apply(tmp_path, mutant)
    assert used is not None, f"{mutant.name}: no snippet occurs exactly once in {mutant.file} (fix scripts/mutate.py)"
    assert dst.read_text() != src.read_text()


def test_mutant_names_are_unique():
    names = [m.name for m in MUTATE.MUTANTS]
    assert len(names) == len(set(names))

"""The drafter protocol the decode loops read (``bitmtp.decoding.drafters.DraftSource``): every drafter —
the single ones and the lookup+adapter pair — carries its capabilities as typed class attributes, and the
decode loops read them directly, never through ``getattr`` probing (issue "Many sequences in one step",
item 1: a missing capability must be an AttributeError at the first test, not a silent default)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import bitmtp.decoding.drafters as drafters
from bitmtp.decoding.policies import get_policy, policy_names
from tests.support.paths import REPO_ROOT

CLASSES = [c for _, c in inspect.getmembers(drafters, inspect.isclass)
           if c.__module__ == drafters.__name__ and (issubclass(c, drafters.Drafter) or c is drafters.CombinedDrafter)
           and not inspect.isabstract(c)]


def test_every_drafter_class_is_found() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"MaskBlockDrafter", "HeadsDrafter", "OracleDrafter", "LookupDrafter", "CombinedDrafter"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_drafter_capabilities_are_typed_class_attributes(cls) -> None:
    assert isinstance(cls.kind, str) and cls.kind and cls.kind != "drafter", cls
    assert isinstance(cls.host_guesses, bool)
    assert cls.fused_drafts in ("", "masks", "heads")
    assert callable(cls.check_block)


def test_pair_is_a_draft_source_with_its_adapters_fused_drafts() -> None:
    class Adapter:  # the attributes a pair reads of its adapter
        max_block, fused_drafts = 8, "masks"

        def check_block(self, block_size: int) -> None:
            raise AssertionError(block_size)

    pair = drafters.CombinedDrafter(drafters.LookupDrafter.__new__(drafters.LookupDrafter), Adapter())
    assert isinstance(pair, drafters.DraftSource)
    assert pair.fused_drafts == "masks" and pair.host_guesses and pair.max_block == 8
    with pytest.raises(AssertionError):
        pair.check_block(9)


@pytest.mark.parametrize("name", policy_names())
def test_policy_capabilities_are_declared(name: str) -> None:
    cls = get_policy(name)
    assert isinstance(cls.uses_costs, bool) and isinstance(cls.plans_runner_ups, bool)
    assert cls.uses_costs == (name == "auto") and cls.plans_runner_ups == (name == "auto")


@pytest.mark.parametrize("path", ["bitmtp/runtime/decode.py", "bitmtp/runtime/batch.py", "bitmtp/runtime/two_pass.py",
                                  "bitmtp/runtime/pass_layouts.py"])
def test_decode_loops_do_not_probe_capabilities(path: str) -> None:
    tree = ast.parse((REPO_ROOT / Path(path)).read_text())
    probes = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]
    assert not probes, f"{path}: getattr/hasattr at lines {probes}: read the typed attribute instead"

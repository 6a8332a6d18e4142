"""Every policy's tokens equal the golden file recorded before the issue-22 refactor (scripts/golden_tokens.py).

Rule: token for token, on SmolLM2-135M-Instruct, AR and confidence / speculative / hybrid with both
shipped drafters at D = 2, 4, 8 (20 chat prompts × 64 tokens; CI runs the first two prompts).
Slow: ``python -m pytest -m slow tests/test_golden_tokens.py``.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support.paths import REPO_ROOT as ROOT
from tests.support.smollm2 import smollm2_or_skip


def _golden():
    spec = importlib.util.spec_from_file_location("golden_tokens", ROOT / "scripts" / "golden_tokens.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("golden_tokens", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("prompts", [2, None], ids=["golden_first_two", "golden_all"])
def test_policies_equal_the_golden_tokens(prompts):
    smollm2_or_skip()
    checked, bad = _golden().differences(prompts)
    assert checked == (prompts or 20) * 31
    assert not bad, "\n".join(bad[:10])

"""Shared test setup: fixtures and collection hooks (importable helpers live in tests/support/).

Triton kernels run through the interpreter on machines without a GPU: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before anything imports bitmtp's kernels.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Step-cost calibrations (policy="auto") go to a per-session folder, never the user's cache."""
    old = os.environ.get("BITMTP_CACHE_DIR")
    os.environ["BITMTP_CACHE_DIR"] = str(tmp_path_factory.mktemp("bitmtp-cache"))
    yield
    if old is None:
        os.environ.pop("BITMTP_CACHE_DIR", None)
    else:
        os.environ["BITMTP_CACHE_DIR"] = old


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (run bench/gpu_check.sh on one)")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)


@pytest.fixture
def rng() -> torch.Generator:
    """A freshly seeded generator per test (random inputs, reproducible failures)."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    print(f"rng seed {seed}")
    return g


@pytest.fixture
def no_dynamo():
    """transformers wraps BitNet helpers in torch.compile; run them eagerly (same math, no compiler)."""
    import torch._dynamo

    old = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = old


@pytest.fixture
def solo_engine(monkeypatch):
    """``bitmtp.generate`` of one prompt on the solo engine (``model.engine``) whatever its policy, as
    ``batcher=False`` does: for the tests of the solo loop itself (its prefix cache, its reads, its calibration,
    its stats); by default ``ar`` and ``auto`` on the CPU decode as a batch of one (``bitmtp.api.batches_alone``)."""
    import bitmtp.api

    monkeypatch.setattr(bitmtp.api, "batches_alone", lambda model, cfg: False)

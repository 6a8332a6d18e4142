"""Shared test setup.

Triton kernels run through the interpreter on machines without a GPU: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before anything imports bitmtp's kernels.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

POISON_INT = -0x5EEDBAD  # written into outputs first, so an unwritten element shows


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


def random_ternary(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)


def random_int8(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations over the full int8 range (-128 included), never all zero."""
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int16)
    x[:, 0] = torch.where(x[:, 0] == 0, torch.full_like(x[:, 0], -128), x[:, 0])
    return x.to(torch.int8)


def triton_available() -> bool:
    from bitmtp.ops.registry import availability

    return availability("triton", "cpu")[0] or (torch.cuda.is_available() and availability("triton", "cuda")[0])


@pytest.fixture
def no_dynamo():
    """transformers wraps BitNet helpers in torch.compile; run them eagerly (same math, no compiler)."""
    import torch._dynamo

    old = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = old

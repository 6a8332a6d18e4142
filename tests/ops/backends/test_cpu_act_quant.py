"""Activation quantization inside the native CPU extension (csrc/cpu/layers.cpp ``act_quant_rows``).

Rules: ``act_quant``'s x_q and scales equal the torch reference (``quantize_activations``) bit for bit, at
every width, awkward K, every float dtype and at the edges (zero rows, ties, huge and tiny magnitudes);
``w2a8_linear`` on the cpu backend quantizes inside its one extension call and gives exactly the bits of
the two-call path (reference quantization, then the kernel) on every ISA path.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp.formats import pack_t2
from bitmtp.formats.quantize import quantize_activations
from bitmtp.ops import TernaryLinear, registry, w2a8_linear
from bitmtp.ops import reference as ref_ops
from tests.support.cpu_native import ISAS, cpu_backend
from tests.support.random_inputs import random_ternary

pytestmark = pytest.mark.skipif(not ISAS, reason="native CPU extension not built")

WIDTHS = [1, 3, 8, 15, 16]
KS = [1, 31, 577, 2560]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _rows(m: int, k: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes (each row's scale differs), never all zero."""
    mag = torch.exp(torch.empty(m, 1).uniform_(-8, 8, generator=g))
    return (torch.randn(m, k, generator=g) * mag).to(dtype)


@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_act_quant_equals_reference(m, k, dtype, rng):
    x = _rows(m, k, rng, dtype)
    x_q, s = registry.backend("cpu").act_quant(x)
    ref_q, ref_s = quantize_activations(x)
    assert x_q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(x_q, ref_q) and torch.equal(s, ref_s)


def test_act_quant_edges_and_poisoned_outputs():
    """Zero rows (scale 127 / 1e-5), exact ties (round half to even), huge and tiny magnitudes, leading
    dimensions; the raw entry writes every element of poisoned buffers."""
    k = 40
    ties = torch.arange(k, dtype=torch.float32) - 19.5  # amax 20.5 -> s = 127/20.5: ties after scaling too
    ties127 = torch.cat([torch.tensor([127.0]), torch.arange(k - 1, dtype=torch.float32) * 0.5 - 9.5])  # s = 1
    x = torch.stack([torch.zeros(k), ties, ties127, torch.full((k,), 3e38), torch.full((k,), -1e-30),
                     torch.linspace(-1e-6, 1e-6, k)])
    cpu = registry.backend("cpu")
    x_q, s = cpu.act_quant(x)
    ref_q, ref_s = quantize_activations(x)
    assert torch.equal(x_q, ref_q) and torch.equal(s, ref_s)
    x3 = x.reshape(2, 3, k)
    q3, s3 = cpu.act_quant(x3)
    assert q3.shape == (2, 3, k) and s3.shape == (2, 3) and torch.equal(q3.reshape(6, k), ref_q)
    q = torch.full((6, k), 99, dtype=torch.int8)
    sc = torch.full((6,), float("nan"))
    cpu._ext.act_quant(x.data_ptr(), 6, k, q.data_ptr(), sc.data_ptr())
    assert torch.equal(q, ref_q) and torch.equal(sc, ref_s)
    with pytest.raises(ValueError, match="act_quant: needs 1 <= M"):
        cpu._ext.act_quant(x.data_ptr(), 0, k, q.data_ptr(), sc.data_ptr())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("n,k,group", [(24, 48, 48), (131, 577, 577), (40, 1040, 16), (7, 400, 64)])
def test_fused_linear_equals_two_calls(isa, m, n, k, group, rng):
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(n, -(-k // group), generator=rng) + 0.1
    bias = torch.randn(n, generator=rng)
    x = _rows(m, k, rng, torch.float32)
    cpu = registry.backend("cpu")
    with cpu_backend.forced_isa(isa):
        fused = cpu.w2a8_linear(x, packed, scales, k, group, bias, torch.float32)
        x_q, s = ref_ops.act_quant_reference(x)
        two = cpu.w2a8_linear_q(x_q, s, packed, scales, k, group, bias, torch.float32)
        front = w2a8_linear(x, packed, scales, group_size=group, bias=bias, backend="cpu")
    assert torch.equal(fused, two) and torch.equal(front, two)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_front_door_fused_in_other_dtypes(dtype, rng):
    n, k = 33, 200
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(1, 1, generator=rng) + 0.1
    x = _rows(3, k, rng, dtype)
    got = w2a8_linear(x, packed, scales, backend="cpu")
    x_q, s = quantize_activations(x)
    want = registry.backend("cpu").w2a8_linear_q(x_q, s, packed, scales, k, k, None, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_ternary_linear_runs_no_torch_op_quantization(monkeypatch, rng):
    """On the cpu backend the layer's quantization happens inside the extension call: the torch reference is
    never called (it used to be, as 8 ops whose libgomp region fought the extension's thread team)."""
    n, k = 50, 96
    layer = TernaryLinear(k, n, pack_t2(random_ternary(n, k, rng)), torch.rand(n, 1, generator=rng) + 0.1,
                          backend="cpu")
    x = torch.randn(2, 4, k, generator=rng)
    want = layer(x)

    def boom(*a, **kw):
        raise AssertionError("torch-op activation quantization ran")

    monkeypatch.setattr(ref_ops, "act_quant_reference", boom)
    monkeypatch.setattr("bitmtp.formats.quantize.quantize_activations", boom)
    assert torch.equal(layer(x), want) and want.shape == (2, 4, n)


def test_an_overridden_kernel_keeps_the_two_call_path(rng):
    """A kernel replaced through registry.override (the benchmark gate's delay injection) is what runs."""
    n, k = 20, 64
    packed = pack_t2(random_ternary(n, k, rng))
    x = torch.randn(1, k, generator=rng)
    calls = []
    cpu = registry.backend("cpu")

    def spy(*args, **kw):
        calls.append(1)
        return cpu.w2a8_linear_q(*args, **kw)

    with registry.override("cpu", "w2a8_linear_q", spy):
        w2a8_linear(x, packed, torch.ones(1, 1), backend="cpu")
    assert calls == [1]

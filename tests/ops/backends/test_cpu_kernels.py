"""Native CPU kernels (csrc/cpu): every ISA path forced in turn, bit-exact integer accumulators,
float epilogue against the float64 reference, and bad input at the kernel boundary.

Rule: int32 accumulators equal the int64 reference exactly; float outputs satisfy the bound of
tests/ops/test_w2a8_linear.py (1e-5 relative + 1e-6 of the summed term magnitudes).
"""

from __future__ import annotations

import sys

import pytest
import torch

from bitmtp.errors import BackendUnavailableError, BitMTPError, LayoutError, ShapeError
from bitmtp.formats import pack_t2
from bitmtp.ops import reference, registry, w2a8_linear
from tests.support.cpu_native import ISAS, cpu_backend
from tests.support.random_inputs import POISON_INT, random_int8, random_ternary
from tests.support.w2a8 import check_float

pytestmark = pytest.mark.skipif(not ISAS, reason="native CPU extension not built")

WIDTHS = [1, 2, 3, 8, 15, 16, 33]
SHAPES = [(24, 48), (200, 176), (7, 400), (131, 33), (5, 1040)]  # (N, K)
SCALE_KINDS = ["tensor", "row", "group16", "group32", "group64", "group128"]


def _scales(kind, n, k, g):
    if kind == "tensor":
        return torch.rand(1, 1, generator=g) + 0.1, k
    if kind == "row":
        return torch.rand(n, 1, generator=g) + 0.1, k
    group = {"group16": 16, "group32": 32, "group64": 64, "group128": 128}[kind]
    return torch.rand(n, -(-k // group), generator=g) + 0.1, group


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
def test_every_isa_exact(isa, m, n, k, scale_kind, rng):
    backend = cpu_backend.CpuBackend()
    packed = pack_t2(random_ternary(n, k, rng))
    scales, group = _scales(scale_kind, n, k, rng)
    x_q = random_int8(m, k, rng)
    ng = -(-k // group)
    acc = torch.full((m, n, ng), POISON_INT, dtype=torch.int32)
    s = torch.rand(m, generator=rng) * 50 + 0.5
    bias = torch.randn(n, generator=rng)
    y = torch.full((m, n), float("nan"))
    with cpu_backend.forced_isa(isa):
        backend.w2a8_accumulate(x_q, packed, k, group, out=acc)
        backend.w2a8_linear_q(x_q, s, packed, scales, k, group, bias, torch.float32, out=y)
    assert torch.equal(acc.to(torch.int64), reference.w2a8_accumulate_reference(x_q, packed, k, group))
    check_float(y, x_q, s, packed, scales, k, group, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scale_kind", ["tensor", "row", "group64", "group48"])
@pytest.mark.parametrize("n,k", [(53, 2560), (29, 720)])
def test_rows_do_not_depend_on_width(isa, scale_kind, n, k, rng):
    """Every width 1..17 (token chunks of 4 + 5, 6 + 7 and 8 + 9 mix row blocks of 4 and 3 on the AVX-512
    path), plus 24 and 33: accumulators exact, each float row bitwise equal to that row computed alone.
    group64 takes the AVX-512 broadcast layout with many groups (double partials of the unswizzled
    lanes), group48 (3 words per group) the plain layout; n = 53 leaves rows past the last block."""
    backend = cpu_backend.CpuBackend()
    packed = pack_t2(random_ternary(n, k, rng))
    group = {"tensor": k, "row": k, "group64": 64, "group48": 48}[scale_kind]
    ng = -(-k // group)
    scales = torch.rand(1 if scale_kind == "tensor" else n, ng, generator=rng) + 0.1
    x_q = random_int8(40, k, rng)
    s = torch.rand(40, generator=rng) * 50 + 0.5
    with cpu_backend.forced_isa(isa):
        alone = []
        for i in range(40):
            y1 = torch.full((1, n), float("nan"))
            backend.w2a8_linear_q(x_q[i : i + 1], s[i : i + 1], packed, scales, k, group, None, torch.float32, out=y1)
            alone.append(y1[0])
        for m in [*range(1, 18), 24, 33]:
            acc = torch.full((m, n, ng), POISON_INT, dtype=torch.int32)
            y = torch.full((m, n), float("nan"))
            backend.w2a8_accumulate(x_q[:m], packed, k, group, out=acc)
            backend.w2a8_linear_q(x_q[:m], s[:m], packed, scales, k, group, None, torch.float32, out=y)
            assert torch.equal(acc.long(), reference.w2a8_accumulate_reference(x_q[:m], packed, k, group)), m
            for i in range(m):
                assert torch.equal(y[i], alone[i]), (m, i)
    check_float(torch.stack(alone), x_q, s, packed, scales, k, group)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_extreme_values_exact_over_long_rows(isa, m, rng):
    """Saturation bound of the AVX2 path's int16 partial sums (w2a8_avx2.cpp: 64 steps of 32 weights
    per run, each int16 lane gaining c0*x0 + c1*x1 in [-512, 508]): rows of all +1 against x = -128 reach
    -32768 exactly at the end of a run, all +1 against x = 127 reach 32512; K = 4192 is two full runs, a
    partial run and a one-word tail. Random rows and activations fill the rest, per-tensor and per-row
    scales (one group spanning every run) and 128-weight groups. Accumulators equal the reference."""
    backend = cpu_backend.CpuBackend()
    n, k = 13, 4192
    w = random_ternary(n, k, rng)
    w[0] = 1
    w[1] = 1
    w[2] = -1
    w[3, : k // 2] = 1
    w[3, k // 2 :] = -1
    packed = pack_t2(w)
    x_q = random_int8(m, k, rng)
    x_q[0] = -128
    if m > 1:
        x_q[1] = 127
    if m > 2:
        x_q[2, ::2] = -128
        x_q[2, 1::2] = 127
    for group in (k, 128):
        ng = -(-k // group)
        acc = torch.full((m, n, ng), POISON_INT, dtype=torch.int32)
        with cpu_backend.forced_isa(isa):
            backend.w2a8_accumulate(x_q, packed, k, group, out=acc)
        ref = reference.w2a8_accumulate_reference(x_q, packed, k, group)
        assert torch.equal(acc.long(), ref), group
        if group == k:
            assert ref[0, 0, 0] == -128 * k  # the all -128 row really took the extreme path


@pytest.mark.parametrize("isa", ISAS)
def test_isa_paths_agree_on_large_width(isa, rng):
    """M = 40 runs in chunks of 16 (16 + 16 + 8); every chunk must be written."""
    backend = cpu_backend.CpuBackend()
    n, k, m = 64, 2560, 40
    packed = pack_t2(random_ternary(n, k, rng))
    x_q = random_int8(m, k, rng)
    acc = torch.full((m, n, 20), POISON_INT, dtype=torch.int32)
    with cpu_backend.forced_isa(isa):
        backend.w2a8_accumulate(x_q, packed, k, 128, out=acc)
    assert torch.equal(acc.long(), reference.w2a8_accumulate_reference(x_q, packed, k, 128))


def test_front_door_uses_cpu_backend_bf16_out(rng):
    n, k = 40, 176
    packed = pack_t2(random_ternary(n, k, rng))
    x = torch.randn(3, k, generator=rng)
    y32 = w2a8_linear(x, packed, torch.ones(1, 1), backend="cpu")
    y16 = w2a8_linear(x, packed, torch.ones(1, 1), backend="cpu", out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16))
    assert registry.select("w2a8_linear_q", torch.device("cpu")).__self__.name == "cpu"  # automatic choice


def test_kernel_boundary_rejects_bad_input(rng):
    backend = cpu_backend.CpuBackend()
    n, k = 24, 48
    packed = pack_t2(random_ternary(n, k, rng))
    x_q = random_int8(3, k, rng)
    s = torch.ones(3)
    sc = torch.ones(1, 1)
    with pytest.raises(ShapeError, match="M"):
        backend.w2a8_accumulate(x_q[:0], packed, k, k)
    with pytest.raises(LayoutError, match="x_q"):
        backend.w2a8_accumulate(random_int8(3, 2 * k, rng)[:, ::2], packed, k, k)
    with pytest.raises(LayoutError, match="weight"):
        backend.w2a8_accumulate(x_q, torch.zeros(n, 6, dtype=torch.int32)[:, ::2], k, k)
    with pytest.raises(BitMTPError, match="x_q"):
        backend.w2a8_accumulate(x_q.to(torch.int16), packed, k, k)
    with pytest.raises(BitMTPError, match="weight"):
        backend.w2a8_accumulate(x_q, packed.to(torch.int64), k, k)
    with pytest.raises(ShapeError, match="words per row"):  # K not matching the padded packed rows
        backend.w2a8_accumulate(random_int8(3, 64, rng), packed, 64, 64)
    with pytest.raises(ShapeError, match="group_size"):
        backend.w2a8_linear_q(x_q, s, packed, torch.ones(1, 2), k, 24, None, torch.float32)
    with pytest.raises(LayoutError, match="out"):
        backend.w2a8_linear_q(x_q, s, packed, sc, k, k, None, torch.float32, out=torch.empty(n, 3).T)
    buf = bytearray(4 * n * 3 + 1)
    try:
        misaligned = torch.frombuffer(buf, dtype=torch.int32, offset=1, count=n * 3).view(n, 3)
    except (ValueError, RuntimeError):
        misaligned = None  # this torch refuses to build a misaligned tensor at all
    if misaligned is not None and misaligned.data_ptr() % 4:
        with pytest.raises(LayoutError, match="aligned"):
            backend.w2a8_accumulate(x_q, misaligned, k, k)


def test_forcing_an_unknown_or_unsupported_isa(monkeypatch):
    with pytest.raises(BitMTPError, match="isa"):
        with cpu_backend.forced_isa("neon"):
            pass
    monkeypatch.setenv(cpu_backend.ISA_ENV, "sse9")
    with pytest.raises(BitMTPError, match=cpu_backend.ISA_ENV):
        cpu_backend.CpuBackend()._isa()
    if "avx512_vnni" not in ISAS:
        monkeypatch.setenv(cpu_backend.ISA_ENV, "avx512_vnni")
        with pytest.raises(BackendUnavailableError):
            cpu_backend.CpuBackend()._isa()


def test_package_works_without_the_extension(monkeypatch):
    """With the extension missing, the registry says why and the automatic choice runs torch."""
    monkeypatch.setitem(sys.modules, "bitmtp._cpu_w2a8", None)  # makes `import` raise ImportError
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "_BACKENDS", {k: v for k, v in registry._BACKENDS.items() if k != "cpu"})
    monkeypatch.setattr(registry, "_LOAD_ERRORS", {})
    ok, why = registry.availability("cpu", "cpu")
    assert not ok and "native CPU kernels missing" in why and "slower" in why
    impl = registry.select("w2a8_linear_q", torch.device("cpu"))
    assert impl.__self__.name == "torch"
    with pytest.raises(BackendUnavailableError, match="native CPU kernels missing"):
        registry.select("w2a8_linear_q", torch.device("cpu"), "cpu")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 15, 16, 33])
@pytest.mark.parametrize("n,k", [(24, 48), (200, 176), (7, 33), (131, 576), (5, 1041), (50, 1041), (53, 3001)])
def test_dense_gemv_matches_float64_and_is_row_independent(isa, m, n, k, rng):
    """Dense float32 GEMV: within 1e-5·Σ|terms| of float64; every row bitwise equal to the same row
    computed alone (the summation order never depends on the width). (50, 1041) and (53, 3001) take the
    K-chunked path (dense_block.inc: a token chunk's activations over 12 KiB) from M = 3 and M = 2 on,
    in two K chunks, with rows past the last 24-row span; alone, (53, 3001) at M = 1 takes the plain one."""
    backend = cpu_backend.CpuBackend()
    w = torch.randn(n, k, generator=rng)
    x = torch.randn(m, k, generator=rng)
    bias = torch.randn(n, generator=rng)
    with cpu_backend.forced_isa(isa):
        y = backend.dense_linear(x, w, bias)
        alone = [backend.dense_linear(x[i : i + 1], w, bias) for i in range(m)]
    ref = x.double() @ w.double().T + bias.double()
    mag = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double() - ref).abs() <= 1e-5 * mag).all()
    for i in range(m):
        assert torch.equal(alone[i][0], y[i])

"""The ``cuda`` backend (csrc/cuda through CuPy/NVRTC) against the reference.

Rules (as in test_w2a8_linear.py): integer accumulators equal the int64 reference bit for bit;
fp32 outputs satisfy |y − ref| ≤ 1e-5·|ref| + 1e-6·Σ_g|acc_g·scale_g/s|; bf16 outputs are exactly
the kernel's own fp32 result rounded to nearest-even (torch's rounding) and within bf16 rounding of
the reference. Outputs are poisoned first, and sit inside a larger poisoned buffer, so an element a
kernel never writes — or writes out of bounds — shows up.

Every test here needs an NVIDIA GPU (marker ``cuda``; skipped elsewhere by tests/conftest.py). References
run on the CPU: CUDA has no int64 matmul. The host-side parts of the backend (launch planner, source
discovery) run anywhere: tests/ops/backends/test_cuda_planning.py.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import BackendUnavailableError, BitMTPError, DeviceError, DTypeError, LayoutError, ShapeError
from bitmtp.formats import pack_t2, quantize_activations
from bitmtp.ops import reference, w2a8_accumulate, w2a8_linear
from bitmtp.ops.backends import cuda_backend
from bitmtp.ops.registry import availability, select
from tests.support.random_inputs import POISON_INT, random_int8, random_ternary

pytestmark = pytest.mark.cuda

WIDTHS = list(range(1, 17)) + [17, 33, 40, 100]
KS = [48, 176, 400, 33, 2560]
NS = [24, 200, 7, 384]
SCALE_KINDS = ["tensor", "row", "group16", "group32", "group128"]
DEV = torch.device("cuda", 0)
GUARD = 97  # poisoned elements after every output, to catch out-of-bounds writes


@pytest.fixture(scope="module")
def backend():
    ok, why = availability("cuda", DEV)
    if not ok:
        pytest.fail(f"cuda backend unavailable on a GPU machine: {why}")
    return select("w2a8_linear_q", DEV, "cuda").__self__


def _scales(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Scales for ``kind``; group32/group128 leave a partial last group for most K here."""
    if kind == "tensor":
        return torch.rand(1, 1, generator=g) + 0.1, k
    if kind == "row":
        return torch.rand(n, 1, generator=g) + 0.1, k
    group = {"group16": 16, "group32": 32, "group128": 128, "group48": 48, "group512": 512, "group2048": 2048}[kind]
    return torch.rand(n, -(-k // group), generator=g) + 0.1, group


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a contiguous poisoned view at the start of a poisoned buffer ``GUARD`` longer."""
    numel = 1
    for s in shape:
        numel *= s
    fill = POISON_INT if dtype == torch.int32 else float("nan")
    buf = torch.full((numel + GUARD,), fill, dtype=dtype, device=DEV)
    return buf[:numel].view(shape), buf


def _guard_intact(buf: torch.Tensor) -> bool:
    tail = buf[-GUARD:]
    return bool((tail == POISON_INT).all()) if buf.dtype == torch.int32 else bool(tail.isnan().all())


def _float_error(y: torch.Tensor, acc: torch.Tensor, s: torch.Tensor, scales: torch.Tensor, bias) -> float:
    """Worst |y − ref| as a multiple of the tolerance (≤ 1 passes); acc is the int64 reference."""
    n = acc.shape[1]
    w_scale = scales.double().expand(n, scales.shape[1])
    terms = acc.double() * w_scale.unsqueeze(0)
    ref = terms.sum(-1) / s.double()[:, None]
    if bias is not None:
        ref = ref + bias.double()
    mag = terms.abs().sum(-1) / s.double()[:, None]
    err = (y.double().cpu() - ref).abs()
    bound = 1e-5 * ref.abs() + 1e-6 * mag + 1e-30
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return (err / bound).max().item()


def _check_case(backend, m: int, n: int, k: int, kind: str, g: torch.Generator, *, bias: bool, where: str,
                packed_offset: int = 0, x_offset: int = 0) -> None:
    """Accumulators, fp32 and bf16 outputs of one shape against the CPU reference."""
    w = random_ternary(n, k, g)
    packed_cpu = pack_t2(w)
    x_cpu = random_int8(m, k, g)
    scales_cpu, group = _scales(kind, n, k, g)
    s_cpu = torch.rand(m, generator=g) * 50 + 0.5
    b_cpu = torch.randn(n, generator=g) if bias else None
    ng = -(-k // group)
    ref = reference.w2a8_accumulate_reference(x_cpu, packed_cpu, k, group)

    packed = _at_offset(packed_cpu, packed_offset)
    x_q = _at_offset(x_cpu, x_offset)
    scales, s = scales_cpu.to(DEV), s_cpu.to(DEV)
    b = b_cpu.to(DEV) if b_cpu is not None else None
    plan = cuda_backend.plan_w2a8(
        m, n, k, group, shared_scales=scales.shape[0] == 1, flags=0, rows_aligned16=packed.data_ptr() % 16 == 0
    )
    tag = f"{where}: M={m} N={n} K={k} {kind} bias={bias} -> {plan.name}"

    acc, acc_buf = _poisoned((m, n, ng), torch.int32)
    backend.w2a8_accumulate(x_q, packed, k, group, out=acc)
    torch.cuda.synchronize()
    assert _guard_intact(acc_buf), f"{tag}: wrote past the end of the accumulators"
    assert torch.equal(acc.cpu().to(torch.int64), ref), f"{tag}: int32 accumulators differ from the reference"

    y32, y32_buf = _poisoned((m, n), torch.float32)
    backend.w2a8_linear_q(x_q, s, packed, scales, k, group, b, torch.float32, out=y32)
    yb, yb_buf = _poisoned((m, n), torch.bfloat16)
    backend.w2a8_linear_q(x_q, s, packed, scales, k, group, b, torch.bfloat16, out=yb)
    torch.cuda.synchronize()
    assert _guard_intact(y32_buf) and _guard_intact(yb_buf), f"{tag}: wrote past the end of the output"
    worst = _float_error(y32, ref, s_cpu, scales_cpu, b_cpu)
    assert worst <= 1.0, f"{tag}: fp32 epilogue off by {worst:.3g}x the tolerance"
    assert torch.equal(yb, y32.to(torch.bfloat16)), f"{tag}: bf16 output is not the fp32 result rounded to nearest-even"


def _at_offset(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """``t`` copied to the GPU at an address ``offset_bytes`` past a 16-byte boundary."""
    if offset_bytes == 0:
        return t.to(DEV)
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + 64, dtype=torch.uint8, device=DEV)
    start = (-raw.data_ptr()) % 16 + offset_bytes
    view = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t.to(DEV))
    assert view.data_ptr() % 16 == offset_bytes % 16
    return view


@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("m", WIDTHS)
def test_exact_accumulators_and_epilogue(backend, m, kind, rng):
    """Every width × every (N, K) × a scale kind: exact ints, fp32 and bf16 outputs, half with bias."""
    for n in NS:
        for k in KS:
            _check_case(backend, m, n, k, kind, rng, bias=(n + k + m) % 2 == 1, where="sweep")


@pytest.mark.parametrize(
    "m,n,k,kind",
    [
        (1, 24, 2560, "group512"),  # V = 8 units of 4 words (VEC = 4), or V = 32 words (VEC = 1)
        (16, 200, 2560, "group2048"),  # V = 32 units: one group per step, partial last group
        (5, 384, 4100, "group2048"),  # K % 64 != 0: 32-bit loads, V = 128 words = 4 steps per group
        (3, 200, 400, "group48"),  # 3 words per group: no exact lane segment -> tiled kernel at M = 3
        (12, 7, 1040, "group128"),  # KW = 65: 32-bit loads, V = 8
        (1, 7, 33, "row"),
        (100, 384, 2560, "group128"),
        (40, 200, 4100, "tensor"),
    ],
)
def test_group_layouts(backend, m, n, k, kind, rng):
    """Group sizes that take each decode lane-segment layout, and the tiled fallback."""
    _check_case(backend, m, n, k, kind, rng, bias=True, where="layouts")


@pytest.mark.parametrize("packed_offset,x_offset", [(4, 0), (8, 0), (12, 0), (0, 1), (0, 4), (0, 8), (4, 3)])
@pytest.mark.parametrize("m", [1, 4, 9, 16, 33])
@pytest.mark.parametrize("n,k", [(200, 2560), (24, 400), (7, 33)])
def test_unaligned_inputs(backend, m, n, k, packed_offset, x_offset, rng):
    """Weights off a 16-byte boundary take the 32-bit loads; activations off it (or K % 16 != 0)
    take the byte loads. Results stay exact."""
    _check_case(backend, m, n, k, "group32" if k % 32 == 0 else "row", rng, bias=False, where="unaligned",
                packed_offset=packed_offset, x_offset=x_offset)


@pytest.mark.parametrize("m", [1, 8, 16, 40])
def test_front_door_and_auto_selection(m, rng):
    """``w2a8_linear`` / ``w2a8_accumulate`` with backend="cuda" and automatically on CUDA tensors."""
    n, k = 200, 176
    packed = pack_t2(random_ternary(n, k, rng)).to(DEV)
    scales = (torch.rand(n, 11, generator=rng) + 0.1).to(DEV)
    bias = torch.randn(n, generator=rng).to(DEV)
    x = (torch.randn(2, m, k, generator=rng) * 4).to(DEV)
    ok, why = availability("cuda", DEV)
    assert ok, why
    assert select("w2a8_linear_q", DEV).__self__.name == "cuda"  # preferred on CUDA devices
    x_q, s = quantize_activations(x.reshape(-1, k))  # what the front door quantizes with, on the GPU
    ref = reference.w2a8_linear_q_reference(x_q.cpu(), s.cpu(), packed.cpu(), scales.cpu(), k, 16, bias.cpu())
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = w2a8_linear(x, packed, scales, bias=bias, out_dtype=out_dtype, backend="cuda")
        assert y.shape == (2, m, n) and y.dtype == out_dtype and y.device == x.device
        tol = 2**-8 if out_dtype != torch.float32 else 1e-5
        assert torch.allclose(y.reshape(-1, n).double().cpu(), ref, rtol=tol, atol=1e-5 * ref.abs().max().item())
    x_q = random_int8(m, k, rng)
    acc = w2a8_accumulate(x_q.to(DEV), packed.view(torch.uint32), group_size=16, backend="cuda")
    assert torch.equal(acc.cpu().long(), reference.w2a8_accumulate_reference(x_q, packed.cpu(), k, 16))


def test_float64_output_through_float32_buffer(backend, rng):
    n, k, m = 24, 400, 3
    packed = pack_t2(random_ternary(n, k, rng)).to(DEV)
    scales = (torch.rand(1, 1, generator=rng) + 0.1).to(DEV)
    x_q, s = random_int8(m, k, rng).to(DEV), (torch.rand(m, generator=rng) + 0.5).to(DEV)
    y32 = backend.w2a8_linear_q(x_q, s, packed, scales, k, k, None, torch.float32)
    y64 = backend.w2a8_linear_q(x_q, s, packed, scales, k, k, None, torch.float64)
    assert y64.dtype == torch.float64 and torch.equal(y64, y32.double())
    out = torch.empty(m, n, dtype=torch.float16, device=DEV)
    assert backend.w2a8_linear_q(x_q, s, packed, scales, k, k, None, torch.float16, out=out) is out
    assert torch.equal(out, y32.half())


@pytest.mark.parametrize("m", [1, 7, 16, 48])
def test_cuda_graph_replay_matches_eager(backend, m, rng):
    """Launches go to torch's current stream, so a captured graph replays them; replay is bitwise
    equal to eager, also after the static inputs change in place."""
    n, k, group = 384, 2560, 128
    packed = pack_t2(random_ternary(n, k, rng)).to(DEV)
    scales = (torch.rand(n, k // group, generator=rng) + 0.1).to(DEV)
    bias = torch.randn(n, generator=rng).to(DEV)
    x_q = random_int8(m, k, rng).to(DEV)
    s = (torch.rand(m, generator=rng) * 50 + 0.5).to(DEV)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)

    def step():
        backend.w2a8_linear_q(x_q, s, packed, scales, k, group, bias, torch.bfloat16, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles and loads the module outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out), "graph replay differs from the eager launch"
        x_q.copy_(random_int8(m, k, rng).to(DEV))  # new static inputs for the next round
        s.copy_((torch.rand(m, generator=rng) * 50 + 0.5).to(DEV))


def test_bad_inputs_raise(backend, rng):
    n, k, m = 24, 48, 2
    packed = pack_t2(random_ternary(n, k, rng)).to(DEV)
    scales = torch.ones(1, 1, device=DEV)
    x_q = random_int8(m, k, rng).to(DEV)
    s = torch.ones(m, device=DEV)
    lin = backend.w2a8_linear_q
    with pytest.raises(BackendUnavailableError):
        backend.w2a8_accumulate(x_q.cpu(), packed.cpu(), k, k)
    with pytest.raises(LayoutError):
        backend.w2a8_accumulate(random_int8(k, m, rng).to(DEV).T, packed, k, k)  # non-contiguous x_q
    with pytest.raises(ShapeError):
        backend.w2a8_accumulate(x_q[:0], packed, k, k)  # M = 0
    with pytest.raises(ShapeError):
        backend.w2a8_accumulate(x_q, packed, 40, 40)  # k does not match x_q
    with pytest.raises(ShapeError):
        backend.w2a8_accumulate(x_q, packed, k, 24)  # group not a multiple of 16
    with pytest.raises(DTypeError):
        backend.w2a8_accumulate(x_q.to(torch.int16), packed, k, k)
    with pytest.raises(ShapeError):
        backend.w2a8_accumulate(x_q, packed, k, k, out=torch.empty(m, n, 2, dtype=torch.int32, device=DEV))
    with pytest.raises(LayoutError):
        backend.w2a8_accumulate(x_q, torch.empty(n, 6, dtype=torch.int32, device=DEV)[:, ::2], k, k)
    with pytest.raises(ShapeError):
        lin(x_q, s, packed, torch.ones(2, 1, device=DEV), k, k, None, torch.float32)  # scales rows
    with pytest.raises(ShapeError):
        lin(x_q, s, packed, torch.ones(1, 2, device=DEV), k, 16, None, torch.float32)  # 3 groups needed
    with pytest.raises(DTypeError):
        lin(x_q, s, packed, scales.double(), k, k, None, torch.float32)
    with pytest.raises(ShapeError):
        lin(x_q, s[:1], packed, scales, k, k, None, torch.float32)
    with pytest.raises(DeviceError):
        lin(x_q, s.cpu(), packed, scales, k, k, None, torch.float32)
    with pytest.raises(ShapeError):
        lin(x_q, s, packed, scales, k, k, torch.ones(n + 1, device=DEV), torch.float32)
    with pytest.raises(ShapeError):
        lin(x_q, s, packed, scales, k, k, None, torch.float32, out=torch.empty(m, n + 1, device=DEV))
    with pytest.raises(LayoutError):
        lin(x_q, s, packed, scales, k, k, None, torch.float32, out=torch.empty(n, m, device=DEV).T)
    with pytest.raises(BitMTPError):
        lin(x_q, s, packed, scales, k, k, None, torch.int32)

"""argmax_prob: each logits row's first argmax and softmax probability.

Rules: the cpu kernel's tokens equal the first index of each row's max exactly, and its probabilities
equal, bit for bit, a numpy float32 replay of csrc/cpu/argmax_prob.h (chunks of 4096, 16 lanes, the
kernels' exponential), on every ISA path and thread count; both are within 2e-5 (relative) of the float64
``1 / sum(exp(x - max))``. The torch reference (softmax then max, float32) is held to the same float64 rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.errors import BitMTPError, ShapeError
from bitmtp.ops import argmax_prob
from bitmtp.ops.registry import availability
from tests.support.attention_replay import attn_exp
from tests.support.cpu_native import ISAS, cpu_backend

BACKENDS = [b for b in ("torch", "cpu") if availability(b, "cpu")[0]]
CHUNK = 4096
REL_TOL = 2e-5
native = pytest.mark.skipif(not ISAS, reason="the native CPU extension is not built (scripts/setup.sh builds it)")


def _logits(g: torch.Generator, m: int, v: int, spread: float = 8.0) -> torch.Tensor:
    return torch.randn(m, v, generator=g) * spread


def _replay(x: np.ndarray) -> tuple[int, np.float32]:
    """One row through argmax_prob.h's definition, operation by operation in numpy float32."""
    f = np.float32
    x = x.astype(np.float32)
    if np.isnan(x).any():
        return int(np.flatnonzero(np.isnan(x))[0]), f("nan")
    parts = []
    for start in range(0, len(x), CHUNK):
        c = x[start : start + CHUNK]
        m_c = c.max()
        if m_c == -np.inf:
            parts.append((m_c, f(0)))
            continue
        padded = np.full(-(-len(c) // 16) * 16, -np.inf, np.float32)
        padded[: len(c)] = c
        w = attn_exp(padded - m_c).reshape(-1, 16)
        lanes = np.zeros(16, np.float32)
        for row in w:  # lane i sums l = i, i + 16, ... in increasing l
            lanes = (lanes + row).astype(np.float32)
        t = f(0)
        for lane in lanes:
            t = f(t + lane)
        parts.append((m_c, t))
    m = x.max()
    tok = int(np.flatnonzero(x == m)[0])
    if m == -np.inf:
        return tok, f("nan")
    total = f(0)
    for m_c, t in parts:
        if m_c == -np.inf:
            continue
        total = f(total + f(t * attn_exp(np.float32(m_c - m))))
    with np.errstate(divide="ignore", invalid="ignore"):
        return tok, f(f(1) / total)


def _float64(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.double()
    mx, tok = x.max(dim=-1)
    return tok, 1.0 / torch.exp(x - mx[:, None]).sum(dim=-1)


def _direct(ext, logits: torch.Tensor, threads: int, isa: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The extension called on poisoned outputs: an element it leaves unwritten shows."""
    m, v = logits.shape
    tok = torch.full((m,), -7, dtype=torch.long)
    prob = torch.full((m,), 12345.0)
    ext.argmax_prob(logits.data_ptr(), m, v, tok.data_ptr(), prob.data_ptr(), threads, isa)
    return tok, prob


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 8, 15, 16])
@pytest.mark.parametrize("v", [1, 17, 1000, 4097, 49155])
def test_matches_float64(backend, m, v, rng):
    logits = _logits(rng, m, v)
    tok, prob = argmax_prob(logits, backend=backend)
    ref_tok, ref_prob = _float64(logits)
    assert tok.dtype == torch.long and prob.dtype == torch.float32 and tok.shape == prob.shape == (m,)
    assert torch.equal(tok, ref_tok)
    assert ((prob.double() - ref_prob).abs() / ref_prob).max().item() <= REL_TOL


@native
@pytest.mark.parametrize("m,v", [(1, 49152), (3, 4096), (5, 4095), (2, 8193), (16, 37), (15, 12289)])
def test_cpu_bits_equal_the_replay_on_every_isa_and_thread_count(m, v, rng):
    ext = cpu_backend._load_extension()
    logits = _logits(rng, m, v, spread=float(torch.empty(1).uniform_(0.5, 30.0, generator=rng)))
    want = [_replay(row) for row in logits.numpy()]
    for isa in range(ext.best_isa() + 1):
        for threads in (1, 2, 3, 7):
            tok, prob = _direct(ext, logits, threads, isa)
            assert tok.tolist() == [t for t, _ in want], (isa, threads)
            assert prob.numpy().tobytes() == np.array([p for _, p in want], np.float32).tobytes(), (isa, threads)


@native
def test_cpu_rows_do_not_depend_on_the_other_rows(rng):
    logits = _logits(rng, 9, 20000)
    together = argmax_prob(logits, backend="cpu")
    for i in range(9):
        alone = argmax_prob(logits[i : i + 1].clone(), backend="cpu")
        assert alone[0].item() == together[0][i].item()
        assert alone[1].numpy().tobytes() == together[1][i : i + 1].numpy().tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_pick_the_first_index_even_across_chunks(backend, rng):
    v = 3 * CHUNK + 11
    logits = _logits(rng, 4, v, spread=1.0)
    spots = [(0, [5, 9]), (1, [CHUNK - 1, CHUNK]), (2, [CHUNK + 3, 2 * CHUNK + 7, v - 1]), (3, [v - 2, v - 1])]
    for row, cols in spots:
        logits[row, cols] = 50.0
    tok, prob = argmax_prob(logits, backend=backend)
    assert tok.tolist() == [cols[0] for _, cols in spots]
    ref = _float64(logits)[1]
    assert ((prob.double() - ref).abs() / ref).max().item() <= REL_TOL


@native
def test_cpu_edges_nan_and_infinities(rng):
    ext = cpu_backend._load_extension()
    for isa in range(ext.best_isa() + 1):  # every ISA path this CPU runs
        _check_edges(ext, isa, rng)


def _check_edges(ext, isa: int, rng: torch.Generator) -> None:
    v = 2 * CHUNK + 5
    logits = _logits(rng, 6, v)
    logits[0, [CHUNK + 2, 17]] = float("nan")  # first NaN wins, prob NaN
    logits[1] = float("-inf")  # softmax undefined: NaN, token 0 (the first max)
    logits[2, : CHUNK + 1] = float("-inf")  # whole chunk of -inf: weight 0, not NaN
    logits[3, [40, CHUNK * 2 + 1]] = float("inf")  # +inf: the first one, prob NaN
    logits[4, :] = -1e30  # finite and huge: every term 1 -> prob 1/v
    logits[5, 3] = 1e30  # one finite winner far above the rest: prob exactly 1
    tok, prob = _direct(ext, logits, 2, isa)
    assert tok.tolist() == [17, 0, int(logits[2].argmax()), 40, 0, 3]
    assert torch.isnan(prob[[0, 1, 3]]).all()
    ref = _float64(logits[2:3])[1].item()
    assert abs(prob[2].item() - ref) / ref <= REL_TOL
    assert abs(prob[4].item() - 1 / v) * v <= REL_TOL
    assert prob[5].item() == 1.0


@native
def test_cpu_zero_rows_and_odd_inputs():
    empty = torch.empty(0, 5)
    tok, prob = argmax_prob(empty, backend="cpu")
    assert tok.shape == prob.shape == (0,)
    wide = torch.randn(10, 3)[:, 1:]  # not contiguous: copied first
    assert torch.equal(argmax_prob(wide, backend="cpu")[0], wide.argmax(-1))
    half = torch.randn(4, 33).half()  # not float32: the torch reference
    assert torch.equal(argmax_prob(half, backend="cpu")[0], half.float().argmax(-1))


@pytest.mark.parametrize("bad", [torch.randn(5), torch.randn(2, 3, 4), torch.empty(3, 0),
                                 torch.ones(2, 4, dtype=torch.long)])
def test_bad_shapes_name_the_input(bad):
    with pytest.raises(ShapeError, match="logits: expected a floating") as info:
        argmax_prob(bad)
    assert isinstance(info.value, BitMTPError)


@native
def test_extension_refuses_bad_arguments():
    ext = cpu_backend._load_extension()
    x = torch.randn(2, 8)
    out = torch.empty(2, dtype=torch.long)
    p = torch.empty(2)
    with pytest.raises(Exception, match="argmax_prob: bad shape"):
        ext.argmax_prob(x.data_ptr(), 2, 0, out.data_ptr(), p.data_ptr(), 1)
    with pytest.raises(Exception, match="argmax_prob: null pointer"):
        ext.argmax_prob(0, 2, 8, out.data_ptr(), p.data_ptr(), 1)


@native
def test_cpu_choice_does_not_go_through_torch_softmax(monkeypatch, rng):
    """The reason the op exists: a CPU step's choice runs on the extension, not on torch's softmax/max (whose
    OpenMP regions left spinning workers on the cores the next step's kernels need)."""
    calls = []
    real = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    tok, _ = argmax_prob(_logits(rng, 2, 49152))
    assert not calls and tok.shape == (2,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_out_buffers_get_the_same_choice(backend, m, rng):
    """``out=(tok, prob)``: a step's static output buffers receive exactly what the plain call returns (poisoned
    first, so an unwritten row shows); strided buffers and other dtypes still get it; a wrong buffer is refused."""
    logits = _logits(rng, m, 1003)
    want_t, want_p = argmax_prob(logits, backend=backend)
    tok, prob = torch.full((m,), -7, dtype=torch.long), torch.full((m,), float("nan"))
    got = argmax_prob(logits, backend=backend, out=(tok, prob))
    assert got[0] is tok and got[1] is prob
    assert torch.equal(tok, want_t) and torch.equal(prob, want_p)
    wide_t, wide_p = torch.full((m, 2), -7, dtype=torch.long), torch.full((m, 2), float("nan"))
    argmax_prob(logits, backend=backend, out=(wide_t[:, 0], wide_p[:, 0]))  # strided views
    assert torch.equal(wide_t[:, 0], want_t) and torch.equal(wide_p[:, 0], want_p)
    half_t, half_p = torch.empty(m, dtype=torch.long), torch.empty(m)
    argmax_prob(logits.double(), backend=backend, out=(half_t, half_p))
    assert torch.equal(half_t, argmax_prob(logits.double(), backend=backend)[0])
    with pytest.raises(ShapeError, match="out"):
        argmax_prob(logits, backend=backend, out=(torch.empty(m + 1, dtype=torch.long), prob))
    with pytest.raises(ShapeError, match="out"):
        argmax_prob(logits, backend=backend, out=(tok, torch.empty(m, dtype=torch.float64)))

"""A step's tail in one call (``bitmtp.ops.head.norm_head_argmax``). Rule: its tokens, probabilities and logits are
the bits of the three ops one after the other — ``rms_norm``, ``dense_linear`` (float32 weight or GGML blocks, with
or without a bias) and ``argmax_prob`` — on the ``cpu`` backend's one native call and on every other path (another
backend chosen for one of the ops, gradients); every output is written (buffers poisoned first); bad shapes get a
ShapeError naming the argument."""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import ShapeError
from bitmtp.formats import ggml_blocks as gb
from bitmtp.ops import registry
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.head import norm_head_argmax
from bitmtp.ops.linear import dense_linear
from bitmtp.ops.norm import rms_norm

NATIVE = registry.availability("cpu", "cpu")[0]


def _head(fmt: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, gb.BlockWeight | None]:
    """A float32 LM head ``[n, k]`` and, for a block format, the blocks encoding it exactly."""
    if fmt == "f32":
        return torch.randn(n, k, generator=g) * 0.05, None
    b = k // 32
    d = (torch.rand(n, b, generator=g) * 0.02 + 1e-3).half().float()
    if fmt == "q8_0":
        blocks = gb.pack(fmt, torch.randint(-128, 128, (n, k), generator=g), d)
    elif fmt == "q4_1":
        blocks = gb.pack(fmt, torch.randint(0, 16, (n, k), generator=g), d, (-8 * d).half().float())
    else:
        blocks = gb.from_half((torch.randn(n, k, generator=g) * 0.05).bfloat16())
    return gb.dequantize(blocks), blocks


def _three_ops(x, norm_w, eps, weight, blocks, bias):
    logits = dense_linear(rms_norm(x, norm_w, eps), weight, bias, blocks=blocks)
    tok, prob = argmax_prob(logits)
    return tok, prob, logits


def _poisoned(m: int, n: int):
    return (torch.full((m,), -7, dtype=torch.long), torch.full((m,), float("nan"))), torch.full((m, n), float("nan"))


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_1", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 8, 15, 16])
@pytest.mark.parametrize("n,k", [(37, 96), (1000, 608)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_three_ops_bits(fmt, m, n, k, with_bias, rng):
    x = torch.randn(m, k, generator=rng) * torch.rand(m, 1, generator=rng) * 6
    norm_w = torch.randn(k, generator=rng)
    weight, blocks = _head(fmt, n, k, rng)
    bias = torch.randn(n, generator=rng) if with_bias else None
    out, logits_out = _poisoned(m, n)
    tok, prob, logits = norm_head_argmax(x, norm_w, 1e-5, None if blocks is not None else weight, blocks=blocks,
                                         bias=bias, out=out, logits_out=logits_out)
    assert tok is out[0] and prob is out[1] and logits is logits_out  # written in place
    want = _three_ops(x, norm_w, 1e-5, None if blocks is not None else weight, blocks, bias)
    for got, w in zip((tok, prob, logits), want, strict=True):
        assert torch.equal(got, w)
    # and the reference values: float64 norm and head, within 1e-5 of the terms' magnitudes
    x64 = x.double()
    h = norm_w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = h @ weight.double().T + (bias.double() if bias is not None else 0.0)
    mag = h.abs() @ weight.double().abs().T + (bias.double().abs() if bias is not None else 0.0)
    assert ((logits.double() - ref).abs() <= 1e-5 * mag + 1e-6).all()
    assert torch.equal(tok, logits.argmax(-1))


@pytest.fixture
def native_tails(monkeypatch):
    """The arguments of every call into the extension's norm_head_argmax while the test runs."""
    if not NATIVE:
        pytest.skip("native CPU extension not built")
    cpu = registry.backend("cpu")
    calls = []
    real_ext = cpu._ext

    class Counting:
        """The extension, counting its norm_head_argmax calls."""

        def __getattr__(self, name):
            return getattr(real_ext, name)

        def norm_head_argmax(self, *a):
            calls.append(a)
            return real_ext.norm_head_argmax(*a)

    monkeypatch.setattr(cpu, "_ext", Counting())
    return calls


def test_one_native_call_on_the_cpu_and_the_three_ops_elsewhere(native_tails, rng):
    """With the ``cpu`` backend chosen for all three ops the tail is one call into the extension; with another
    backend chosen for any of them (an override here) the three ops run, each through its own choice."""
    calls = native_tails
    x, norm_w = torch.randn(3, 64, generator=rng), torch.randn(64, generator=rng)
    weight, blocks = _head("q8_0", 50, 64, rng)
    got = norm_head_argmax(x, norm_w, 1e-6, None, blocks=blocks)
    assert len(calls) == 1
    want = _three_ops(x, norm_w, 1e-6, None, blocks, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    seen = []

    def torch_dense(x, w, b=None):
        seen.append("dense")
        return x @ w.T + (b if b is not None else 0)

    with registry.override("cpu", "dense_linear", torch_dense):
        got = norm_head_argmax(x, norm_w, 1e-6, weight)
    assert len(calls) == 1 and seen == ["dense"]  # not the native tail: the overridden op ran
    assert torch.equal(got[2], torch_dense(rms_norm(x, norm_w, 1e-6), weight))


def test_rows_that_need_gradients_take_the_three_ops(native_tails, rng):
    """The native norm runs only on rows that need no gradient: such rows take the three ops (whose choices
    decide what they support), never the one call."""
    x = torch.randn(2, 64, generator=rng, requires_grad=True)
    norm_w = torch.randn(64, generator=rng)
    weight, _ = _head("f32", 20, 64, rng)
    got = norm_head_argmax(x, norm_w, 1e-6, weight)
    want = _three_ops(x, norm_w, 1e-6, weight, None, None)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got, want, strict=True))
    assert native_tails == []
    norm_head_argmax(x.detach(), norm_w, 1e-6, weight)
    assert len(native_tails) == 1


def test_no_rows(rng):
    """A step whose rows are all prompt rows before a prompt's last reads none: empty choices, [0, N] logits."""
    norm_w = torch.randn(64, generator=rng)
    weight, blocks = _head("q8_0", 20, 64, rng)
    out, logits_out = _poisoned(0, 20)
    tok, prob, logits = norm_head_argmax(torch.randn(0, 64), norm_w, 1e-6, None, blocks=blocks, out=out,
                                         logits_out=logits_out)
    assert tok is out[0] and prob is out[1] and logits is logits_out and logits.shape == (0, 20)
    tok, prob, logits = norm_head_argmax(torch.randn(0, 64), norm_w, 1e-6, weight)
    assert (tok.shape, prob.shape, logits.shape) == ((0,), (0,), (0, 20)) and tok.dtype == torch.long


def test_bad_shapes_are_named(rng):
    x, norm_w = torch.randn(2, 64, generator=rng), torch.randn(64, generator=rng)
    weight, blocks = _head("q8_0", 20, 64, rng)
    with pytest.raises(ShapeError, match="x: expected rows"):
        norm_head_argmax(x[0], norm_w, 1e-6, weight)
    with pytest.raises(ShapeError, match="norm weight"):
        norm_head_argmax(x, norm_w[:32], 1e-6, weight)
    with pytest.raises(ShapeError, match="K=96"):
        norm_head_argmax(x, norm_w, 1e-6, torch.randn(20, 96))
    with pytest.raises(ShapeError, match="logits_out"):
        norm_head_argmax(x, norm_w, 1e-6, None, blocks=blocks, logits_out=torch.empty(2, 21))
    with pytest.raises(ShapeError, match="out"):
        norm_head_argmax(x, norm_w, 1e-6, weight, out=(torch.empty(3, dtype=torch.long), torch.empty(3)))
    with pytest.raises(ShapeError, match="weight"):
        norm_head_argmax(x, norm_w, 1e-6, None)

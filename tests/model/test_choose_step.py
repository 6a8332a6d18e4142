"""A whole step in one native call (``Decoder.choose_step``): where the layers run fused on the CPU, the final norm,
the LM head and the choice run inside the layers' call. Rule: the tokens, probabilities and logits of the rows read
are the bits of ``choose(hidden_states(step, kv, norm=False)[heads])`` — the layers' call, then the tail's — and so
are the KV rows written; the step is ONE call into the extension (no ``norm_head_argmax`` call after it); every
output is written (buffers poisoned first); bad tail buffers get a BitMTPError naming them."""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.formats import ggml_blocks as gb
from bitmtp.model.decoder import FUSED, StepInputs
from bitmtp.ops import registry
from bitmtp.ops.fused_layers import TailCall
from bitmtp.runtime.kv import KVStore
from tests.support.hf_models import tiny_model

NATIVE = registry.availability("cpu", "cpu")[0]
pytestmark = pytest.mark.skipif(not NATIVE, reason="native CPU extension not built (the step's one call is native)")


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def decoder(request):
    """A tiny Llama's decoder; ``q8_0``: its LM head held as GGML blocks (as a GGUF checkpoint's)."""
    model = bitmtp.load(tiny_model("llama", seed=5, vocab_size=200), capacity=128)
    dec = model.decoder
    if request.param == "q8_0":
        head = dec.lm_head
        w = head.weight.detach()
        n, k = w.shape
        d = (w.abs().reshape(n, k // 32, 32).amax(-1) / 127).clamp_min(1e-4).half().float()
        q = torch.round(w.reshape(n, k // 32, 32) / d[..., None]).clamp(-128, 127).reshape(n, k)
        blocks = gb.pack("q8_0", q.long(), d)
        head.weight.data.copy_(gb.dequantize(blocks))
        assert head.pack_blocks(("q8_0",)) is not None
        dec.invalidate_native()
    return dec


def _kv(dec) -> KVStore:
    a = dec.args
    return KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 128, 16)


def _step(m: int, start: int, g: torch.Generator) -> StepInputs:
    pos = torch.arange(start, start + m)
    mask = torch.arange(start + m)[None, :] <= pos[:, None]
    return StepInputs(torch.randint(3, 190, (m,), generator=g), pos, mask)


@pytest.fixture
def ext_calls(monkeypatch, decoder):
    """The names of the extension's entry points called while the test runs (by the ops and the fused layers)."""
    cpu = registry.backend("cpu")
    calls: list[str] = []
    real = cpu._ext

    class Counting:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if not callable(fn):
                return fn

            def call(*a, **k):
                calls.append(name)
                return fn(*a, **k)

            return call

    counting = Counting()
    monkeypatch.setattr(cpu, "_ext", counting)
    monkeypatch.setattr(decoder.fused_plan(), "ext", counting)
    return calls


@pytest.mark.parametrize("m,heads", [(1, None), (3, None), (8, [7]), (15, [0, 4, 14]), (16, list(range(16)))])
@pytest.mark.parametrize("with_logits", [True, False])
def test_one_call_has_the_bits_of_the_layers_then_the_tail(decoder, ext_calls, m, heads, with_logits, rng):
    prompt = _step(9, 0, rng)
    step = _step(m, 9, rng)
    kv_one, kv_two = _kv(decoder), _kv(decoder)
    with torch.no_grad():
        for kv in (kv_one, kv_two):
            decoder.hidden_states(prompt, kv)
        r = m if heads is None else len(heads)
        out = (torch.full((r,), -7, dtype=torch.long), torch.full((r,), float("nan")))
        logits_out = torch.full((r, decoder.args.vocab_size), float("nan")) if with_logits else None
        ext_calls.clear()
        tok, prob, logits = decoder.choose_step(step, kv_one, heads, out=out, logits_out=logits_out)
        assert ext_calls == ["fused_layers"] and decoder.last_path == FUSED  # the whole step: one call
        hidden = decoder.hidden_states(step, kv_two, norm=False)
        want = decoder.choose(hidden if heads is None else hidden[torch.tensor(heads)])
    assert tok is out[0] and prob is out[1] and logits is logits_out
    assert torch.equal(tok, want[0]) and torch.equal(prob, want[1])
    if with_logits:
        assert torch.equal(logits, want[2])
    for layer in range(decoder.args.num_layers):  # the KV rows the step wrote: the same bits
        assert torch.equal(kv_one.k[layer], kv_two.k[layer]) and torch.equal(kv_one.v[layer], kv_two.v[layer])


def test_the_tail_runs_after_the_call_where_it_cannot_run_inside(decoder, ext_calls, monkeypatch, rng):
    """A head pinned to another backend keeps the layers fused and runs the three ops after them (the bits of
    ``choose`` after ``hidden_states`` with that head), never the native tail."""
    monkeypatch.setattr(decoder.lm_head, "backend", "torch")
    step = _step(4, 0, rng)
    kv_one, kv_two = _kv(decoder), _kv(decoder)
    with torch.no_grad():
        ext_calls.clear()
        got = decoder.choose_step(step, kv_one, [1, 3])
        assert "fused_layers" in ext_calls and "norm_head_argmax" not in ext_calls
        want = decoder.choose(decoder.hidden_states(step, kv_two, norm=False)[torch.tensor([1, 3])])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_bad_tail_buffers_are_named(decoder, rng):
    plan = decoder.fused_plan()
    spec = decoder._native_tail()
    assert plan is not None and spec is not None
    m = 3
    tok, prob = torch.empty(m, dtype=torch.long), torch.empty(m)
    with pytest.raises(BitMTPError, match="tail: expected contiguous int64"):
        TailCall(spec, None, m, tok.int(), prob).args(m)
    with pytest.raises(BitMTPError, match="tail: logits"):
        TailCall(spec, None, m, tok, prob, torch.empty(m, spec.n + 1)).args(m)
    with pytest.raises(BitMTPError, match="tail: reads 3 rows of a step of 2"):
        TailCall(spec, None, m, tok, prob).args(2)
    with pytest.raises(BitMTPError, match="tail: rows"):
        TailCall(spec, torch.tensor([0, 1], dtype=torch.long), m, tok, prob).args(m)
    step = _step(2, 0, rng)
    tail = TailCall(spec, torch.tensor([0, 1, 5], dtype=torch.long), m, tok, prob)
    with torch.no_grad(), pytest.raises(BitMTPError, match="tail row index is out of range"):
        decoder.hidden_states(step, _kv(decoder), norm=False, tail=tail)


def test_a_new_head_is_followed_after_invalidate_native(rng):
    """The tail's operands are kept between steps (``Decoder._native_tail``): a head whose tensor is replaced is
    followed once ``invalidate_native`` is called (the fused layers' contract), and a new head module at once."""
    model = bitmtp.load(tiny_model("llama", seed=6, vocab_size=200), capacity=64)
    dec = model.decoder
    step = _step(3, 0, rng)

    def both():
        with torch.no_grad():
            got = dec.choose_step(step, _kv(dec))
            want = dec.choose(dec.hidden_states(step, _kv(dec), norm=False))
        return got, want

    got, want = both()
    assert torch.equal(got[0], want[0])
    head = dec.lm_head
    head.weight.data = torch.randn(head.weight.shape, generator=rng) * 0.5  # new storage, the same Parameter
    dec.invalidate_native()
    got, want = both()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    dec.lm_head = type(head)(torch.randn(head.weight.shape, generator=rng) * 0.5)
    got, want = both()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

"""The prompt-prefix cache (``Engine.resume`` / ``Engine.keep``): a generation reuses the KV rows of the longest
prefix of its prompt that the engine's store still holds from the previous generation.

Rule: reuse never changes an output. Every generation after another equals what a fresh engine (a new
``model.session()``) gives for the same prompt and options — greedy and sampled with a seed, for every policy —
and the KV rows [0, n) it leaves equal the fresh engine's bit for bit. With width-invariant rows (the native CPU
layers) any prefix of the previous prompt and of the tokens committed after it is reused; otherwise only whole
prefill chunks of the previous prompt. Whatever writes rows outside a generation (low-level steps, the step-cost
calibration) forgets the cache.
"""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.runtime import calibration as cal
from bitmtp.runtime.engine import Engine
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

# the solo engine's loop: generate's default would decode ar / auto as a batch of one (bitmtp.api.batches_alone)
pytestmark = pytest.mark.usefixtures("solo_engine")

pytest.importorskip("transformers")

NEW = 24

#: (name, generate keywords): every kind of decode loop; the lossy hybrid keeps only its prompt's rows
CONFIGS = [
    ("ar", dict(policy="ar")),
    ("auto", dict(policy="auto", block_size=4)),
    ("one-pass", dict(policy="speculative", schedule="one-pass", drafter="lookup+adapter", block_size=4)),
    ("tree", dict(policy="speculative", schedule="tree", drafter="adapter", block_size=4)),
    ("two-pass", dict(policy="speculative", drafter="adapter", block_size=4)),
    ("hybrid", dict(policy="hybrid", block_size=4)),
    ("sampled-ar", dict(policy="ar", temperature=0.8, top_k=20, seed=7)),
    ("sampled-auto", dict(policy="auto", block_size=4, temperature=0.8, seed=11)),
]


@pytest.fixture(scope="module")
def model():
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary")
    m.load_adapter(random_adapter(m.args, "mask-block", seed=5))
    return m


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 95, (n,), generator=g).tolist()


def _gen(model, ids: list[int], **kw):
    return bitmtp.generate(model, input_ids=ids, max_new_tokens=NEW, eos_token_id=[], **kw)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _assert_rows_equal(eng: Engine, fresh: Engine, n: int) -> None:
    for ours, theirs in zip(eng.kv.k + eng.kv.v, fresh.kv.k + fresh.kv.v, strict=True):
        assert torch.equal(ours[:, :n], theirs[:, :n])


@pytest.mark.parametrize("name, kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_reused_rows_decode_exactly_as_a_fresh_engine(model, name, kw):
    eng = model.engine
    assert eng.rows_width_invariant  # the native CPU layers: any row may be reused
    a = _ids(1, 30)
    first = _gen(model, a, **kw)
    lossless = name != "hybrid"
    kept = (a + first.token_ids)[: eng.n] if lossless else a
    follow_ups = {
        "same prompt": a,
        "next turn": a + first.token_ids + _ids(2, 7),  # the previous prompt, its answer and more
        "part of the prompt": a[:17] + _ids(3, 9),
        "unrelated": _ids(4, 12),
    }
    for what, b in follow_ups.items():
        expect_cached = min(_common(b, kept), len(b) - 1)
        out = _gen(model, b, **kw)
        fresh = model.session()
        ref = _gen(fresh, b, **kw)
        assert out.token_ids == ref.token_ids, (name, what)
        assert out.stats.prompt_cached == expect_cached and ref.stats.prompt_cached == 0, (name, what)
        assert eng.n == fresh.engine.n
        _assert_rows_equal(eng, fresh.engine, eng.n)
        kept = (b + out.token_ids)[: eng.n] if lossless else b


def test_without_width_invariant_rows_only_whole_prefill_chunks_are_reused(model, monkeypatch):
    """A step whose rows' bits may depend on its width (BLAS matmuls, the GPU) reuses only the previous prompt's
    whole prefill chunks: the same computation at the same offsets."""
    monkeypatch.setattr(Engine, "rows_width_invariant", property(lambda self: False))
    eng = model.engine
    chunk = eng.prefill_chunk
    a = _ids(5, chunk + 40)
    first = _gen(model, a, policy="ar")
    cases = [
        (a[: chunk + 20] + _ids(6, 5), chunk),  # shares more than one chunk: the chunk
        (a[: chunk - 3] + _ids(7, 5), 0),  # shares less than a chunk: nothing
        (a + first.token_ids + _ids(8, 3), chunk),  # generated tokens are not reused, nor the partial chunk
    ]
    for b, expect_cached in cases:
        out = _gen(model, b, policy="ar")
        ref = _gen(model.session(), b, policy="ar")
        assert out.token_ids == ref.token_ids and out.stats.prompt_cached == expect_cached
        _gen(model, a, policy="ar")  # the next case starts after ``a`` again


def test_what_writes_rows_outside_a_generation_forgets_the_cache(model):
    eng = model.engine
    a = _ids(9, 20)
    _gen(model, a, policy="ar")
    cal.measure_cost_table(eng, widths=(1, 2), contexts=(4,), repeats=1)  # writes rows at its contexts
    out = _gen(model, a, policy="ar")
    assert out.stats.prompt_cached == 0 and out.token_ids == _gen(model.session(), a, policy="ar").token_ids
    eng.reset()
    assert _gen(model, a, policy="ar").stats.prompt_cached == 0
    eng.prefill(a[:5])  # a low-level step
    assert _gen(model, a, policy="ar").stats.prompt_cached == 0


def test_a_stream_closed_early_keeps_its_prompt_only(model):
    """A generation stopped mid-way (a client that left) leaves its prompt's rows reusable, nothing after."""
    eng = model.engine
    a = _ids(10, 25)
    stream = model.engine.decode(a, max_new_tokens=NEW, policy="ar")
    next(stream)
    next(stream)
    stream.close()
    b = a + _ids(11, 4)
    out = _gen(model, b, policy="ar")
    assert out.stats.prompt_cached == len(a)
    assert out.token_ids == _gen(model.session(), b, policy="ar").token_ids
    assert eng.n >= len(b)

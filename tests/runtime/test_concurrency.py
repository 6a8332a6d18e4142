"""One generation owns a KV store at a time (issue 21, item 1).

Rules: calls on one model from two threads serialize, so every output equals the same call made
alone (tokens and per-iteration commits); two sessions of one model decode in two threads with
their own KV stores, also equal to solo; a stream holds the model from its first piece until it is
exhausted or closed — another generation in the same thread meanwhile raises a BitMTPError that
says so (never a silently wrong output), and a closed, `with`-exited or dropped stream releases it.

The model: a tiny ternary llama with peaky random weights (its greedy outputs use many distinct
tokens, checked below, so a generation continuing on another's KV rows shows) and a random
mask-block adapter, as in the MTP decoding tests (tests/support/adapters.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from tests.support.adapters import INIT_RANGE, TAU, random_adapter
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

NEW = 40
POLICIES = ("ar", "speculative", "hybrid")


class Letters:
    """A stand-in tokenizer for streams: token i decodes to one letter."""

    def decode(self, ids, skip_special_tokens=True, **kw):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary",
                    adapter=None)
    m.load_adapter(random_adapter(m.args, "mask-block", block_size=8, seed=11))
    return m


@pytest.fixture(scope="module")
def jobs():
    """20 (prompt, policy, sampling) triples: prompts of random lengths, the three policies in turn, every other
    pair sampled (seeded, with a penalty: a sampler state shared by mistake shows) and the rest greedy."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"jobs seed {seed}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(20):
        n = int(torch.randint(2, 30, (1,), generator=g))
        sampling = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=i) if i % 4 >= 2 else {}
        out.append((torch.randint(3, 95, (n,), generator=g).tolist(), POLICIES[i % 3], sampling))
    return out


def _run(model, job):
    prompt, policy, sampling = job
    out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, policy=policy, block_size=4, tau=TAU,
                          eos_token_id=[], **sampling)
    return out.token_ids, out.stats.committed


@pytest.fixture(scope="module")
def solo(model, jobs):
    return [_run(model, j) for j in jobs]


def test_the_model_output_varies(solo):
    """Guards the other tests' power: outputs that repeat one token could not show mixed-up KV rows.
    The prompts are fresh random ones each run, and an odd prompt can loop on a few tokens, so most of
    the outputs (not every one) must vary."""
    assert sum(len(set(tokens)) >= 10 for tokens, _ in solo) >= 16
    assert len({tuple(tokens) for tokens, _ in solo}) >= 15


def _in_threads(targets: list, jobs) -> dict[int, tuple]:
    """Run job i on targets[i % len(targets)], one thread per target, started together."""
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def worker(k: int) -> None:
        try:
            start.wait()
            for i in range(k, len(jobs), len(targets)):
                results[i] = _run(targets[k], jobs[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_two_threads_on_one_model_equal_solo(model, jobs, solo):
    """2 threads × 10 generations (ar / speculative / hybrid, mixed prompts) on ONE model."""
    results = _in_threads([model, model], jobs)
    for i, ref in enumerate(solo):
        assert results[i] == ref, f"job {i} ({jobs[i][1]})"
    assert not model.engine.busy


def test_two_sessions_in_two_threads_equal_solo(model, jobs, solo):
    a, b = model.session(), model.session()
    assert a.decoder is model.decoder and a.drafter is model.drafter and a.tokenizer is model.tokenizer
    assert len({id(m.engine.kv) for m in (model, a, b)}) == 3  # own KV stores
    results = _in_threads([a, b], jobs)
    for i, ref in enumerate(solo):
        assert results[i] == ref, f"job {i} ({jobs[i][1]})"


def test_a_session_runs_while_the_model_is_held(model, jobs, solo):
    """A session never waits for its model's generation (nor touches its rows): in the thread that
    holds the model with an open stream, a session's generation runs and is exact."""
    streaming = dataclasses.replace(model, tokenizer=Letters())
    stream = bitmtp.generate(streaming, input_ids=jobs[1][0], max_new_tokens=NEW, policy=jobs[1][1], block_size=4,
                             tau=TAU, eos_token_id=[], stream=True)
    first = next(stream)
    assert model.engine.busy
    session = model.session()
    assert _run(session, jobs[4]) == solo[4]
    rest = "".join(stream)
    assert stream.result.token_ids == solo[1][0] and first + rest == Letters().decode(solo[1][0])
    assert not model.engine.busy


def _stream(model, job):
    """A stream on the solo engine, whose ownership of the model's KV store the tests below check (a batch of
    one — generate's default for ar / auto — owns rows of the batch engine instead: tests/runtime/test_batch.py)."""
    prompt, policy, sampling = job
    return bitmtp.generate(dataclasses.replace(model, tokenizer=Letters()), input_ids=prompt, max_new_tokens=NEW,
                           policy=policy, block_size=4, tau=TAU, eos_token_id=[], stream=True, batcher=False,
                           **sampling)


@pytest.mark.parametrize("second", ["generate", "stream"])
def test_interleaved_streams_in_one_thread_are_exact_or_refused(model, jobs, solo, second):
    s1 = _stream(model, jobs[2])
    pieces = [next(s1), next(s1)]
    if second == "generate":
        with pytest.raises(BitMTPError, match=r"stream on this model is still open.*close\(\).*session\(\)"):
            _run(model, jobs[5])
    else:
        s2 = _stream(model, jobs[5])  # created: nothing runs until its first piece
        with pytest.raises(BitMTPError, match="stream on this model is still open"):
            next(s2)
    pieces += list(s1)  # the refused call did not touch s1's rows
    assert s1.result.token_ids == solo[2][0] and "".join(pieces) == Letters().decode(solo[2][0])
    assert s1.result.stats.committed == solo[2][1]
    if second == "stream":  # refused before it started: it runs once the model is free
        assert "".join(s2) == Letters().decode(solo[5][0]) and s2.result.token_ids == solo[5][0]
    assert _run(model, jobs[5]) == solo[5]


def test_streams_read_one_after_another_are_exact(model, jobs, solo):
    """Several streams created up front, each read to the end in turn: all exact (a stream takes the
    model at its first piece, not when it is created)."""
    streams = [_stream(model, jobs[i]) for i in (0, 1, 2)]
    for i, s in zip((0, 1, 2), streams, strict=True):
        assert "".join(s) == Letters().decode(solo[i][0]) and s.result.token_ids == solo[i][0]


@pytest.mark.parametrize("how", ["close", "with", "del", "exception"])
def test_an_abandoned_stream_releases_the_model(model, jobs, solo, how):
    s = _stream(model, jobs[3])
    if how == "with":
        with s:
            next(s)
            assert model.engine.busy
    elif how == "exception":
        with pytest.raises(KeyError), s:
            next(s)
            raise KeyError("the caller's own error")
    else:
        next(s)
        assert model.engine.busy
        if how == "close":
            s.close()
            s.close()  # idempotent
            assert list(s) == [] and s.result is None
        else:
            del s  # no gc.collect(): reference counting alone must free it (no cycle holds the stream)
    assert not model.engine.busy
    assert _run(model, jobs[6]) == solo[6]


def test_other_threads_wait_for_an_open_stream(model, jobs, solo):
    """A stream held open in this thread: another thread's generate waits (serializes) instead of
    decoding on the stream's KV rows, then runs exactly once the stream is closed."""
    s = _stream(model, jobs[7])
    first = next(s)
    done = threading.Event()
    got: list = []

    def other() -> None:
        got.append(_run(model, jobs[8]))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=1.0)
    assert not done.is_set() and model.engine.busy  # still waiting: the stream owns the store
    rest = "".join(s)  # the stream is unaffected by the waiting call
    assert first + rest == Letters().decode(solo[7][0])
    t.join()
    assert got == [solo[8]]


def test_low_level_steps_refuse_a_held_store(model, jobs):
    s = _stream(model, jobs[0])
    next(s)
    with pytest.raises(BitMTPError, match="prefill: a generation owns"):
        model.engine.prefill([5, 6, 7])
    with pytest.raises(BitMTPError, match="ar_step: a generation owns"):
        model.engine.ar_step(5)
    s.close()
    assert model.engine.prefill([5, 6, 7]) >= 0  # free again


def test_session_is_refused_for_wgpu_models(model):
    wgpu_like = dataclasses.replace(model, plan=object())
    with pytest.raises(BitMTPError, match="session: a runtime='vulkan' model"):
        wgpu_like.session()


def test_patched_hf_model_from_two_threads(tmp_path):
    """bitmtp.patch: generate from two threads on one patched model equals the unpatched outputs, and
    each call's patch stats are its own generation's."""
    from bitmtp.formats.adapters import save_adapter
    from bitmtp.hf import patch_state

    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    g = torch.Generator().manual_seed(77)
    prompts = [torch.randint(3, 90, (1, int(torch.randint(2, 20, (1,), generator=g))), generator=g) for _ in range(6)]
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    refs = [hf.generate(p, **kw) for p in prompts]
    args = bitmtp.load(hf, adapter=None, capacity=64).args
    bitmtp.patch(hf, adapter=save_adapter(tmp_path / "a", *random_adapter(args, "mask-block", block_size=4)),
                 policy="speculative", block_size=4)
    outs: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(k, len(prompts), 2):
                outs[i] = hf.generate(prompts[i], **kw)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, ref in enumerate(refs):
        assert torch.equal(outs[i], ref), f"prompt {i}"
    state = patch_state(hf)
    assert state.calls["bitmtp"] == len(prompts) and sum(state.last_stats.committed) == 23
    bitmtp.unpatch(hf)

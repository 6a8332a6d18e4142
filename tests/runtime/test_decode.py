"""MTP decoding end to end on a tiny random model (ternary W2A8 linears) with random adapters.

Rules stated per test: speculative decoding is lossless (token for token equal to AR greedy on
the same model and backend); hybrid with m > D is speculative and with m ≤ 1 confidence; the KV
rows [0, n) after generation equal a fresh prefill of the committed text, bit for bit; an oracle
drafter commits ≥ D tokens per iteration; every iteration costs exactly one device→host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import bitmtp
from bitmtp.decoding import (
    Commit,
    Plan,
    Policy,
    Verify,
    policy_names,
    register_policy,
    speculative_commit,
    unregister_policy,
)
from bitmtp.decoding.drafters import OracleDrafter
from bitmtp.errors import BitMTPError
from bitmtp.formats.adapters import AdapterConfig, BaseShape, save_adapter
from bitmtp.model.adapters import DraftHeads, MaskBlock, init_adapter_tensors
from bitmtp.model.decoder import StepInputs
from bitmtp.model.layers import rms_norm
from bitmtp.runtime import Engine, KVStore
from tests.support.adapters import INIT_RANGE, TAU, random_adapter
from tests.support.hf_models import tiny_model

# the solo engine's loop: generate's default would decode ar / auto as a batch of one (bitmtp.api.batches_alone)
pytestmark = pytest.mark.usefixtures("solo_engine")

pytest.importorskip("transformers")

N_PROMPTS, NEW = 20, 128
BLOCKS = (2, 4, 8, 16)
KINDS = ("mask-block", "heads")


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=512, quantize="ternary")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 95, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def ar_outputs(model, prompts):
    return [bitmtp.generate(model, input_ids=p, max_new_tokens=NEW, policy="ar", eos_token_id=[]).token_ids
            for p in prompts]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", BLOCKS)
def test_speculative_equals_ar_greedy(model, prompts, ar_outputs, kind, block):
    """Lossless: 20 prompts × 128 new tokens, token for token."""
    model.load_adapter(random_adapter(model.args, kind))
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, policy="speculative", block_size=block,
                              eos_token_id=[])
        assert out.token_ids == ref, f"prompt {prompt}"
        assert out.stats.verifier_rate == 1.0 and sum(out.stats.committed) == NEW - 1


def _noisy_oracle(model, prompt, ref, seed, noise=0.3):
    """An oracle drafter whose known continuation is corrupted at random positions: drafts are
    accepted for a random number of tokens, so every acceptance length a = 1..D occurs."""
    seq = torch.tensor(prompt + ref)
    g = torch.Generator().manual_seed(seed)
    flip = torch.rand(seq.shape, generator=g) < noise
    seq[flip] = torch.randint(3, 95, (int(flip.sum()),), generator=g)
    return OracleDrafter(model.decoder, seq.tolist())


@pytest.mark.parametrize("block", BLOCKS)
def test_partial_acceptance_stays_lossless(model, prompts, ar_outputs, block):
    seen = set()
    for i, (prompt, ref) in enumerate(zip(prompts[:8], ar_outputs[:8], strict=True)):
        drafter = _noisy_oracle(model, prompt, ref, seed=i)
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, policy="speculative", block_size=block,
                              eos_token_id=[], drafter=drafter)
        assert out.token_ids == ref
        seen.update(out.stats.committed)
    assert len(seen) >= min(block, 3)  # several acceptance lengths were exercised


@pytest.mark.parametrize("block", (2, 4, 8, 16))
def test_oracle_commits_at_least_block_per_iteration(model, prompts, ar_outputs, block):
    """The machinery delivers what acceptance allows: a perfect drafter commits D + 1 per iteration
    (D accepted drafts and the verifier's token), except where max_new_tokens cuts the last one."""
    for prompt, ref in zip(prompts[:5], ar_outputs[:5], strict=True):
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, policy="speculative", block_size=block,
                              eos_token_id=[], drafter=OracleDrafter(model.decoder, prompt + ref))
        assert out.token_ids == ref
        full = out.stats.committed[:-1]  # the last iteration may be cut by max_new_tokens
        assert full and all(c == block + 1 for c in full)
        assert sum(full) / len(full) >= block


@pytest.mark.parametrize("kind", KINDS)
def test_quick_lossless_bonus_and_stops(model, prompts, kind):
    """A fast form of the rules above (no 20 × 128 fixture; scripts/mutate.py runs it per mutant):
    on 3 prompts × 40 tokens, speculative at D = 3 and 5 equals AR greedy computed here; a perfect
    (oracle) drafter commits D accepted drafts plus the verifier's bonus token, D + 1, in every full
    iteration; max_new_tokens = 1, 2, 5 give exactly the first 1, 2, 5 AR tokens."""
    model.load_adapter(random_adapter(model.args, kind, seed=4))
    for prompt in prompts[10:13]:
        ar = model.generate_ar(prompt, max_new_tokens=40, eos_token_id=[]).tokens
        for block in (3, 5):
            spec = bitmtp.generate(model, input_ids=prompt, max_new_tokens=40, policy="speculative",
                                   block_size=block, eos_token_id=[])
            assert spec.token_ids == ar, block
            oracle = bitmtp.generate(model, input_ids=prompt, max_new_tokens=40, policy="speculative",
                                     block_size=block, eos_token_id=[],
                                     drafter=OracleDrafter(model.decoder, prompt + ar))
            assert oracle.token_ids == ar
            assert oracle.stats.committed[:-1] == [block + 1] * (len(oracle.stats.committed) - 1)
        for k in (1, 2, 5):
            out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=k, policy="speculative", block_size=4,
                                  eos_token_id=[])
            assert out.token_ids == ar[:k], k


def _decode(model, prompt, **kw):
    return Engine.run(model.engine.decode(prompt, max_new_tokens=NEW, eos=[], **kw))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", (4, 8))
def test_hybrid_limits(model, prompts, kind, block):
    """hybrid with m > D is speculative; with m ≤ 1 it is confidence (same tokens, same iterations).

    Through the engine here; tests/test_api_inputs.py checks the same ends through the public generate()."""
    model.load_adapter(random_adapter(model.args, kind, seed=7))
    common = dict(block_size=block, tau=TAU, drafter=model.drafter)
    for prompt in prompts[:4]:
        spec = _decode(model, prompt, policy="speculative", **common)
        hyb = _decode(model, prompt, policy="hybrid", min_prefix=block + 1, **common)
        assert hyb.tokens == spec.tokens and hyb.stats.committed == spec.stats.committed
        conf = _decode(model, prompt, policy="confidence", **common)
        for m in (1, 0):
            hyb = _decode(model, prompt, policy="hybrid", min_prefix=m, **common)
            assert hyb.tokens == conf.tokens and hyb.stats.committed == conf.stats.committed
            assert hyb.stats.verifier_calls == 0


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_verified_iterations_are_ar_exact(model, prompts, kind):
    """Both branches run (0 < verifier rate < 1), and every verify-decided iteration commits exactly
    what AR greedy emits after the text committed before it."""
    model.load_adapter(random_adapter(model.args, kind, seed=5))
    branches = set()
    for prompt in prompts[:3]:
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=48, policy="hybrid", block_size=4, tau=TAU,
                              min_prefix=2, eos_token_id=[])
        branches.update(out.stats.verified)
        at = 1  # the prefill commits the first token
        for count, verified in zip(out.stats.committed, out.stats.verified, strict=True):
            got = out.token_ids[at : at + count]
            if verified:
                ar = model.generate_ar(prompt + out.token_ids[:at], max_new_tokens=len(got), eos_token_id=[])
                assert ar.tokens == got
            at += count
    assert branches == {True, False}


def _independent_draft(model, text: list[int], d: int) -> tuple[list[int], list[float], float]:
    """d_1..d_D and their probabilities after the committed ``text``, recomputed from scratch without
    the runtime: one forward over the whole text (+ D − 1 mask rows for a mask-block adapter, which
    see every text row and their whole block) in a fresh KV store, or — for draft heads — the last
    text row's hidden state followed by the head recurrence. Also returns the smallest margin
    (top-1 − top-2 probability, |p − τ|) that a last-bit difference would have to cross."""
    dec, drafter, a = model.decoder, model.drafter, model.args
    t = len(text)
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 256, 16)
    cols = torch.arange(256)
    if drafter.kind == "mask-block":
        pos = torch.arange(t + d - 1)
        reach = torch.where(pos < t, pos, t + d - 2)  # text rows causal; mask rows see all ≤ the block's end
        step = StepInputs(torch.tensor(text + [0] * (d - 1)), pos, cols[None, :] <= reach[:, None],
                          mask_rows=d - 1, mask_block=drafter.block)
        probs = [torch.softmax(dec(step, kv)[t - 1 :].double(), -1)]
    else:
        pos = torch.arange(t)
        state = dec.hidden_states(StepInputs(torch.tensor(text), pos, cols[None, :] <= pos[:, None]), kv)[-1:]
        probs = [torch.softmax(dec.logits(state).double(), -1)]
        for k in range(d - 1):
            state = drafter.heads.step(k, state, dec.embed[probs[-1].argmax(-1)])
            probs.append(torch.softmax(dec.logits(state).double(), -1))
    probs = torch.cat(probs)
    assert probs.shape[0] == d
    top2 = probs.topk(2, dim=-1).values
    p = top2[:, 0]
    margin = min((top2[:, 0] - top2[:, 1]).min().item(), (p - TAU).abs().min().item())
    return probs.argmax(-1).tolist(), p.tolist(), margin


@pytest.mark.parametrize("policy", ("confidence", "hybrid"))
@pytest.mark.parametrize("kind", KINDS)
def test_unverified_commits_are_the_confident_prefix_of_an_independent_draft(model, prompts, policy, kind):
    """Every iteration that commits without the verifier (confidence, and hybrid's confident branch)
    commits exactly d_1..d_max(1,h) of the draft recomputed from scratch after the text committed
    before it (``_independent_draft``), h counted here with p ≥ τ. Iterations whose recomputed
    draft sits within 1e-6 of an argmax tie or of τ are not judged (rounding could decide them);
    they must stay rare. Enough iterations commit 3+ tokens that the order of d_2..d_D shows."""
    model.load_adapter(random_adapter(model.args, kind, seed=11))
    d = 4
    judged = skipped = long_commits = 0
    for prompt in prompts[5:9]:
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=40, policy=policy, block_size=d, tau=TAU,
                              min_prefix=2, eos_token_id=[])
        at = 1  # the prefill commits the first token
        for count, verified in zip(out.stats.committed, out.stats.verified, strict=True):
            got = out.token_ids[at : at + count]
            if not verified:
                draft, probs, margin = _independent_draft(model, prompt + out.token_ids[:at], d)
                h = next((i for i, p in enumerate(probs) if not p >= TAU), d)
                want = draft[: max(1, h)]
                if margin < 1e-6:
                    skipped += 1
                else:
                    judged += 1
                    # the last iteration may be cut short by max_new_tokens
                    assert got == (want if at + count < len(out.token_ids) else want[: len(got)]), (at, probs)
                    long_commits += len(want) >= 3
            at += count
        assert at == len(out.token_ids)
    assert judged >= 20 and skipped <= judged // 10
    assert long_commits >= 3


@pytest.mark.parametrize("policy", ("confidence", "speculative", "hybrid"))
@pytest.mark.parametrize("kind", KINDS)
def test_kv_rows_equal_fresh_prefill(model, prompts, policy, kind):
    """Invariant 2, bit for bit (integer-exact linears, row-deterministic attention on the cpu backend;
    close to rounding on the torch reference)."""
    from bitmtp.ops.registry import availability

    model.load_adapter(random_adapter(model.args, kind, seed=9))
    prompt = prompts[2]
    out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=100, policy=policy, block_size=8, tau=TAU,
                          eos_token_id=[])
    eng = model.engine
    n = eng.n
    text = prompt + out.token_ids
    assert len(prompt) < n <= len(text)
    fresh = Engine(model.decoder, capacity=512, m_max=31, prefill_chunk=29)
    fresh.prefill(text[:n])
    exact = availability("cpu", "cpu")[0]
    for ours, ref in zip(eng.kv.k + eng.kv.v, fresh.kv.k + fresh.kv.v, strict=True):
        if exact:
            assert torch.equal(ours[:, :n], ref[:, :n])
        else:
            torch.testing.assert_close(ours[:, :n], ref[:, :n], rtol=1e-4, atol=1e-5)
    assert eng.kv.rows_copied == 0


_SYNC_METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")


@pytest.mark.parametrize("policy", ("ar", "confidence", "speculative", "hybrid"))
def test_one_device_to_host_read_per_iteration(model, prompts, policy, monkeypatch):
    """Instrumented hook: every Tensor method that moves a value to the host is counted while the
    loop runs. Each iteration reads exactly once (+1 for the prefill, and for hybrid at most one
    flush at the end of the KV store), and nothing else in the loop touches a device value."""
    from bitmtp.decoding import policies

    model.load_adapter(random_adapter(model.args, "mask-block", seed=2))
    calls, host = [], []
    for name in _SYNC_METHODS:
        orig = getattr(torch.Tensor, name)

        def hooked(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, hooked)
    # the host form of the acceptance rule (bitmtp/decoding/accept.py) works on the token lists of a read: no
    # device value, counted apart
    rule = policies.speculative_accept
    monkeypatch.setattr(policies, "speculative_accept", lambda d, v: host.append(len(d)) or rule(d, v))
    out = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=60, policy=policy, block_size=4, tau=TAU,
                          eos_token_id=[])
    monkeypatch.undo()
    s = out.stats
    steps = s.iterations if policy == "ar" else s.draft_steps
    assert s.syncs == 1 + steps + s.flushes and s.flushes <= 1
    assert len(calls) == s.syncs, calls
    assert len(host) == s.verifier_calls  # one host acceptance per verify decided
    if policy == "hybrid":
        assert 0 < s.verifier_calls < s.iterations  # both branches ran


def test_capacity_and_eos_stops(model):
    model.load_adapter(random_adapter(model.args, "mask-block"))
    prompt = [3 + i % 90 for i in range(477)]
    for policy in ("speculative", "hybrid", "confidence"):
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=200, policy=policy, block_size=8,
                              tau=TAU, eos_token_id=[])
        assert out.stop_reason == "capacity" and 477 + len(out.token_ids) == 512 + 1
        eos = out.token_ids[5]
        out2 = bitmtp.generate(model, input_ids=prompt, max_new_tokens=200, policy=policy,
                               block_size=8, tau=TAU, eos_token_id=eos)
        assert out2.stop_reason == "eos" and out2.token_ids[-1] == eos and eos not in out2.token_ids[:-1]
        assert out2.token_ids == out.token_ids[: len(out2.token_ids)]


def test_max_new_tokens_one_and_short(model, prompts, ar_outputs):
    model.load_adapter(random_adapter(model.args, "heads"))
    for k in (1, 2, 5):
        out = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=k, policy="speculative", block_size=8,
                              eos_token_id=[])
        assert out.token_ids == ar_outputs[0][:k]


class LetterTokenizer:
    """A test double: token i decodes to one letter; ids 90..96 decode to a two-token character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stream_yields_the_committed_text(prompts):
    model = bitmtp.load(tiny_model("llama", seed=3), capacity=256, quantize="ternary", tokenizer=LetterTokenizer())
    model.load_adapter(random_adapter(model.args, "mask-block"))
    full = bitmtp.generate(model, input_ids=prompts[1], max_new_tokens=40, policy="hybrid", block_size=4, tau=TAU,
                           eos_token_id=[])
    stream = bitmtp.generate(model, input_ids=prompts[1], max_new_tokens=40, policy="hybrid", block_size=4,
                             tau=TAU, eos_token_id=[], stream=True)
    assert stream.result is None  # nothing has run yet
    pieces = list(stream)
    assert "".join(pieces) == full.text == LetterTokenizer().decode(full.token_ids)
    assert stream.result.token_ids == full.token_ids and stream.result.stats.committed == full.stats.committed
    assert len(pieces) > 5  # streamed as committed, not in one piece


def test_adapter_folder_round_trip(model, prompts, tmp_path):
    cfg, tensors = random_adapter(model.args, "heads", block_size=6)
    path = save_adapter(tmp_path / "heads", cfg, tensors)
    model.load_adapter((cfg, tensors))
    a = bitmtp.generate(model, input_ids=prompts[3], max_new_tokens=30, policy="confidence", tau=TAU, eos_token_id=[])
    loaded = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=512, quantize="ternary",
                    adapter=path)
    b = bitmtp.generate(loaded, input_ids=prompts[3], max_new_tokens=30, policy="confidence", tau=TAU,
                        eos_token_id=[])
    assert a.token_ids == b.token_ids and a.stats.block_size == 6  # the adapter's D is the default


def test_fused_gated_lora_matches_per_target_reference(model, rng):
    """The fused q/k/v and gate/up LoRA deltas equal per-target x·Aᵀ·Bᵀ (float64 reference,
    rtol 1e-5), with zeros for targets the adapter does not have."""
    cfg, tensors = random_adapter(model.args, "mask-block", targets=["q", "v", "up", "down"], rank=3)
    block = MaskBlock(cfg, tensors)
    a = model.args
    x = torch.randn(5, a.hidden_size, generator=rng)
    for layer in range(a.num_layers):
        ref = []
        for t, width in (("q", a.q_size), ("k", a.kv_size), ("v", a.kv_size)):
            if t in cfg.targets:
                ref.append(x.double() @ tensors[f"layers.{layer}.{t}.lora_A"].double().T
                           @ tensors[f"layers.{layer}.{t}.lora_B"].double().T)
            else:
                ref.append(torch.zeros(5, width, dtype=torch.float64))
        torch.testing.assert_close(block.delta(layer, "qkv", x).double(), torch.cat(ref, 1), rtol=1e-5, atol=1e-6)
        assert block.delta(layer, "o", x) is None
        gu = block.delta(layer, "gate_up", x).double()
        assert torch.all(gu[:, : a.intermediate_size] == 0)
        a_up, b_up = tensors[f"layers.{layer}.up.lora_A"].double(), tensors[f"layers.{layer}.up.lora_B"].double()
        up = x.double() @ a_up.T @ b_up.T
        torch.testing.assert_close(gu[:, a.intermediate_size :], up, rtol=1e-5, atol=1e-6)


def test_draft_head_step_matches_formula(model, rng):
    """s_k = RMSNorm(W_up·W_down·[s ‖ e] + s) against a float64 reference (rtol 1e-5)."""
    cfg, tensors = random_adapter(model.args, "heads", block_size=4)
    heads = DraftHeads(cfg, tensors, eps=1e-6)
    h = model.args.hidden_size
    s, e = torch.randn(2, h, generator=rng), torch.randn(2, h, generator=rng)
    for k in range(3):
        z = torch.cat([s, e], -1).double()
        pre = z @ tensors[f"heads.{k}.down"].double().T @ tensors[f"heads.{k}.up"].double().T + s.double()
        ref = rms_norm(pre, tensors[f"heads.{k}.norm"].double(), 1e-6)
        torch.testing.assert_close(heads.step(k, s, e).double(), ref, rtol=1e-5, atol=1e-6)


def test_mask_rows_change_drafts_but_not_pending_rows(model, prompts, ar_outputs):
    """The gate: a zero-B adapter and a random one draft differently (LoRA acts on mask rows), while
    d_1 — the pending row's prediction — is the AR token for both."""
    cfg = AdapterConfig("mask-block", 8, 4, BaseShape.of(model.args))
    zero = init_adapter_tensors(cfg, seed=1)
    drafts = []
    for tensors in (zero, init_adapter_tensors(cfg, seed=1, zero_init_b=False, b_std=0.5)):
        model.load_adapter((cfg, tensors))
        out = bitmtp.generate(model, input_ids=prompts[4], max_new_tokens=9, policy="confidence", tau=1e-9,
                              eos_token_id=[])
        assert out.token_ids[:2] == ar_outputs[4][:2]  # prefill token and d_1 of the first iteration
        drafts.append(out.token_ids)
    assert drafts[0] != drafts[1]


def test_bad_input(model, prompts):
    p = prompts[0]
    model.load_adapter(None)
    with pytest.raises(BitMTPError, match="adapter"):
        bitmtp.generate(model, input_ids=p, policy="hybrid")  # a policy that needs an adapter, none loaded
    model.load_adapter(random_adapter(model.args, "mask-block", block_size=8))
    for tau in (0, -0.1, 1.5, float("nan")):
        with pytest.raises(BitMTPError, match="tau"):
            bitmtp.generate(model, input_ids=p, tau=tau)
    for block in (1, 17, 0, 2.5):
        with pytest.raises(BitMTPError, match="block_size"):
            bitmtp.generate(model, input_ids=p, block_size=block)
    with pytest.raises(BitMTPError, match="block_size"):
        bitmtp.generate(model, input_ids=p, block_size=12)  # more than the adapter drafts
    with pytest.raises(BitMTPError, match="min_prefix"):
        bitmtp.generate(model, input_ids=p, block_size=4, min_prefix=-1)  # m > D is valid: speculative-only
    with pytest.raises(BitMTPError, match="policy"):
        bitmtp.generate(model, input_ids=p, policy="beam")
    with pytest.raises(BitMTPError, match="prompt/input_ids"):
        bitmtp.generate(model)
    with pytest.raises(BitMTPError, match="max_new_tokens"):
        bitmtp.generate(model, input_ids=p, max_new_tokens=0)
    with pytest.raises(BitMTPError, match="input_ids"):
        bitmtp.generate(model, input_ids=[3, 1000])
    with pytest.raises(BitMTPError, match="stream"):
        bitmtp.generate(model, input_ids=p, stream=True)  # no tokenizer to stream text with
    # an adapter made for another base model
    other = bitmtp.load(tiny_model("llama", seed=3, hidden_size=32), capacity=64)
    with pytest.raises(BitMTPError, match="hidden_size"):
        model.load_adapter(random_adapter(other.args, "heads"))
    small = bitmtp.load(tiny_model("llama", seed=3), capacity=64, m_max=7)
    small.load_adapter(random_adapter(small.args, "heads", block_size=8))
    with pytest.raises(BitMTPError, match="m_max"):
        bitmtp.generate(small, input_ids=p, policy="speculative", block_size=8)


# --- a new policy is one class plus its tests (issue 22) ---------------------------------------------
# Test-only policies, registered with one call each and removed afterwards; nothing under bitmtp/ is
# patched. Both are checked against AR greedy computed independently (model.generate_ar).


@dataclass(frozen=True)
class FirstKParams:
    """``k``: how many draft tokens an iteration commits (at most D)."""

    k: int = 2

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise BitMTPError(f"k: commit at least one token per iteration (an integer >= 1), got {self.k!r}")


class FirstKPolicy(Policy):
    """Commits d_1..d_min(k, D) of every draft, unverified."""

    name = "first-k"
    Params = FirstKParams

    def commit(self, draft, probs, verify):
        return Commit(tuple(draft[: self.params.k]), exact_rows=0, verified=False)


class EveryOtherPolicy(Policy):
    """Verifies every other iteration (``schedule``: before the read, or decided after it and resolved on
    the device) at the generation's D; in between, a block-2 draft with ``drafter`` of which both
    tokens commit (an oracle's: the AR continuation), or — without one — with the generation's
    drafter, of which only d_1, the AR prediction, commits. So its output is AR greedy's. It counts its
    plans (state of this test double: one plan per draft step)."""

    name = "every-other"
    needs_verify = True

    def __init__(self, schedule=Verify.ALWAYS, drafter=None):
        super().__init__()
        self.schedule, self.drafter, self.plans = schedule, drafter, 0

    def plan(self, block_size, history):
        self.plans += 1
        if self.plans % 2:
            return Plan(block_size, self.schedule)
        return Plan(2, Verify.NEVER, self.drafter)

    def wants_verify(self, draft, probs):
        return True

    def commit(self, draft, probs, verify):
        if verify is None:
            return Commit(tuple(draft[: 1 if self.drafter is None else 2]), exact_rows=0, verified=False)
        return speculative_commit(draft, verify)


@pytest.fixture
def registered():
    """Register the test-only policies (one call each); unregister them afterwards."""
    for cls in (FirstKPolicy, EveryOtherPolicy):
        register_policy(cls)
    yield
    for cls in (FirstKPolicy, EveryOtherPolicy):
        unregister_policy(cls.name)
    assert "first-k" not in policy_names()


@pytest.mark.parametrize("k, block", [(1, 4), (3, 4), (4, 4), (6, 4), (2, 2), (5, 8)])
def test_a_test_only_policy_runs_through_generate(model, prompts, registered, k, block):
    """first-k on the oracle drafter (d_2..d_D = the AR continuation) commits exactly AR greedy's
    tokens, min(k, D) per iteration — by name (its loose τ ignored), as an object, and through the engine."""
    prompt = prompts[6]
    ar = model.generate_ar(prompt, max_new_tokens=30, eos_token_id=[]).tokens
    model.load_adapter(random_adapter(model.args, "mask-block", seed=3))
    oracle = OracleDrafter(model.decoder, prompt + ar)
    by_object = bitmtp.generate(model, input_ids=prompt, max_new_tokens=30, policy=FirstKPolicy(k=k),
                                block_size=block, eos_token_id=[], drafter=oracle)
    assert by_object.token_ids == ar and by_object.stats.policy == "first-k"
    per = min(k, block)
    assert by_object.stats.committed[:-1] == [per] * (len(by_object.stats.committed) - 1)
    assert 1 <= by_object.stats.committed[-1] <= per and by_object.stats.verifier_calls == 0
    if k == 2:  # by name: FirstKParams' default k = 2
        by_name = bitmtp.generate(model, input_ids=prompt, max_new_tokens=30, policy="first-k", block_size=block,
                                  tau=0.5, eos_token_id=[], drafter=oracle)
        assert by_name.token_ids == ar and by_name.stats.committed == by_object.stats.committed
    engine = Engine.run(model.engine.decode(prompt, max_new_tokens=30, eos=[], policy=FirstKPolicy(k=k),
                                            block_size=block, drafter=oracle))
    assert engine.tokens == ar and engine.stats.committed == by_object.stats.committed


def test_a_test_only_policy_validates_its_parameters(model, prompts, registered):
    with pytest.raises(BitMTPError, match="k: commit at least one token"):
        bitmtp.generate(model, input_ids=prompts[0], policy=FirstKPolicy(k=0))
    with pytest.raises(BitMTPError, match="tau: give it to the policy object"):
        bitmtp.generate(model, input_ids=prompts[0], policy=FirstKPolicy(k=2), tau=0.5)
    model.load_adapter(None)
    with pytest.raises(BitMTPError, match="policy: 'first-k' drafts tokens and needs an MTP adapter"):
        bitmtp.generate(model, input_ids=prompts[0], policy="first-k")


@pytest.mark.parametrize("schedule", [Verify.ALWAYS, Verify.DECIDE])
@pytest.mark.parametrize("switch", [False, True])
def test_per_iteration_block_and_drafter_plans(model, prompts, registered, schedule, switch):
    """The plan hook: blocks alternate D = 5 (verified: before the read, or resolved on the device) and
    2 (unverified; with an oracle drafter the plan names, 2 tokens commit, else 1). The output is AR
    greedy's; the iterations alternate verified / unverified commits; one read per draft step still."""
    model.load_adapter(random_adapter(model.args, "heads", seed=8))
    for prompt in prompts[14:16]:
        ar = model.generate_ar(prompt, max_new_tokens=40, eos_token_id=[]).tokens
        other = OracleDrafter(model.decoder, prompt + ar) if switch else None
        pol = EveryOtherPolicy(schedule, other)
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=40, policy=pol, block_size=5,
                              eos_token_id=[])
        assert out.token_ids == ar
        s = out.stats
        assert s.verified == [i % 2 == 0 for i in range(s.iterations)]
        unverified = s.committed[1::2][:-1]  # the last iteration may be cut by max_new_tokens
        assert unverified and all(c == (2 if switch else 1) for c in unverified) and max(s.committed[::2]) > 1
        assert s.verifier_calls == (s.iterations + 1) // 2 and s.widths[5] >= s.verifier_calls
        assert s.syncs == 1 + s.draft_steps + s.flushes
        assert pol.plans == s.draft_steps


def test_a_plan_the_engine_cannot_run_is_refused(model, prompts, registered):
    """Plans are checked each iteration: the block range, the drafter's largest block, the Verify type."""

    class Planned(FirstKPolicy):
        name = "planned"
        planned = Plan(4, Verify.NEVER)

        def plan(self, block_size, history):
            return self.planned if len(history.committed) else Plan(block_size, Verify.NEVER)

    model.load_adapter(random_adapter(model.args, "mask-block", block_size=4, seed=3))
    for plan, match in ((Plan(17, Verify.NEVER), "plan: policy 'planned' planned a block size of 17"),
                        (Plan(1, Verify.NEVER), "block size of 1; .* 2..16"),
                        (Plan(6, Verify.NEVER), "block_size: the mask-block drafter supports D <= 4"),
                        (Plan(3, "always"), "plan: .*Verify member")):
        pol = Planned()
        pol.planned = plan
        with pytest.raises(BitMTPError, match=match):
            bitmtp.generate(model, input_ids=prompts[0], policy=pol, block_size=3, eos_token_id=[])

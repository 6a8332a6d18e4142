"""bfloat16 / float16 checkpoints keep their dense weights as half rows (``ggml_blocks`` formats ``bf16`` / ``f16``).

Rules: a half checkpoint loaded for the CPU holds no float32 copy of its dense projections, embedding or LM head
(lazy ``bf16`` / ``f16`` blocks: half the bytes, what a step streams); widening is exact and the kernels run the
float32 kernel's FMA sequence, so logits equal the same checkpoint loaded on float32 weights
(``BITMTP_DENSE_BLOCKS=0``) bit for bit, fused and per-op, and greedy tokens are identical. A GGUF's F16 / BF16
tensors load as the same blocks, and an export writes them back byte for byte. A live model handed to
``bitmtp.load`` and changed afterwards does not change the loaded decoder.
"""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.formats import ggml_blocks as gb
from bitmtp.model.layers import DenseLinear
from tests.support.hf_models import save_bitnet_packed, tiny_model
from tests.support.model_files import logits

pytest.importorskip("gguf")

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
# K = 96, 160, 96: multiples of 32 (the half rows' block width)
SHAPE = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             num_hidden_layers=2, initializer_range=0.2, vocab_size=128)


def _dense(decoder) -> list[DenseLinear]:
    return [m for m in decoder.modules() if isinstance(m, DenseLinear)]


def _half_model(fmt: str, tie: bool, family: str = "llama"):
    return tiny_model(family, seed=21, tie_word_embeddings=tie, **SHAPE).to(DTYPES[fmt])


def _greedy(model, n: int = 12) -> list[int]:
    return bitmtp.generate(model, input_ids=[3, 17, 41, 5, 99, 12], max_new_tokens=n, policy="ar",
                           eos_token_id=[]).token_ids


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("fmt", list(DTYPES))
def test_half_checkpoint_keeps_half_rows_and_equals_float32_weights(fmt, tie, monkeypatch):
    hf = _half_model(fmt, tie)
    model = bitmtp.load(hf, adapter=None, capacity=64)
    dec = model.decoder
    dense = _dense(dec)
    assert len(dense) == 1 + 4 * dec.args.num_layers
    for m in dense:
        assert m.blocks is not None and m.blocks.fmt == fmt and m.lazy, m
    assert dec.embed_blocks is not None and dec.embed_blocks.fmt == fmt
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("BITMTP_FUSED", fused)
        runs[fused] = (logits(dec), _greedy(model))
        if fused == "1":
            assert dec.fused_reason == "", dec.fused_reason  # the native layers read the half rows
    assert all(m.lazy for m in dense), "a CPU step made a float32 copy of a half weight"
    monkeypatch.setenv("BITMTP_DENSE_BLOCKS", "0")
    plain = bitmtp.load(hf, adapter=None, capacity=64)
    assert all(m.blocks is None and m.weight.dtype == torch.float32 for m in _dense(plain.decoder))
    for fused in ("1", "0"):
        monkeypatch.setenv("BITMTP_FUSED", fused)
        want_logits, want_tokens = logits(plain.decoder), _greedy(plain)
        got_logits, got_tokens = runs[fused]
        assert torch.isfinite(want_logits).all()
        assert torch.equal(got_logits.view(torch.int32), want_logits.view(torch.int32))
        assert got_tokens == want_tokens


def test_half_rows_are_a_copy_of_a_live_models_weights():
    hf = _half_model("bf16", tie=True)
    model = bitmtp.load(hf, adapter=None, capacity=64)
    before = logits(model.decoder)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(2)
    assert torch.equal(logits(model.decoder), before)


def test_float_path_materializes_the_exact_widening():
    hf = _half_model("f16", tie=False)
    model = bitmtp.load(hf, adapter=None, capacity=64)
    head = model.decoder.lm_head
    w = head.weight  # a float path asks: dequantized once, kept
    assert w.dtype == torch.float32 and not head.lazy
    assert torch.equal(w.view(torch.int32), hf.lm_head.weight.detach().float().view(torch.int32))
    assert head.blocks is not None and head.blocks.fmt == "f16"  # the blocks still encode it


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_gguf_half_tensors_load_as_half_rows_and_export_byte_for_byte(fmt, tmp_path):
    from bitmtp.formats.gguf import read_gguf

    source = bitmtp.load(_half_model(fmt, tie=True), adapter=None, capacity=64)
    path = source.save_gguf(tmp_path / "half.gguf", progress=False)
    contents = read_gguf(path)
    matrices = [t for t in contents.tensors.values() if len(t.shape) == 2]
    assert matrices and all(t.type_name == fmt.upper() for t in matrices)
    model = bitmtp.load(path, adapter=None, capacity=64)
    dense = _dense(model.decoder)
    assert all(m.lazy and m.blocks.fmt == fmt for m in dense)
    assert torch.equal(logits(model.decoder), logits(source.decoder))
    assert _greedy(model) == _greedy(source)
    again = read_gguf(model.save_gguf(tmp_path / "again.gguf", progress=False))
    for name, t in contents.tensors.items():
        assert t.type_name == again.tensors[name].type_name and bytes(t.data) == bytes(again.tensors[name].data), name


def test_bitnet_checkpoint_with_a_bf16_embedding(tmp_path):
    """BitNet b1.58-2B-4T's layout: ternary projections, a bfloat16 embedding that is also the LM head."""
    hf = tiny_model("bitnet", seed=4, tie_word_embeddings=True, **SHAPE)
    path = save_bitnet_packed(hf.to(torch.bfloat16), tmp_path / "bitnet")
    model = bitmtp.load(path, adapter=None, capacity=64)
    dec = model.decoder
    assert dec.lm_head.blocks.fmt == "bf16" and dec.lm_head.lazy and dec.embed_blocks is dec.lm_head.blocks
    got = logits(dec), _greedy(model)
    assert dec.lm_head.lazy
    plain = bitmtp.load(path, adapter=None, capacity=64)
    plain.decoder.lm_head.drop_blocks()  # the float32 weight and kernel
    assert plain.decoder.lm_head.blocks is None
    assert torch.equal(got[0], logits(plain.decoder)) and got[1] == _greedy(plain)


def test_odd_widths_stay_float32():
    """K not a multiple of 32: no half rows (the kernels' block width), float32 weights as before."""
    hf = tiny_model("llama", seed=2, hidden_size=72, intermediate_size=120, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=18, num_hidden_layers=1, vocab_size=128).to(torch.bfloat16)
    model = bitmtp.load(hf, adapter=None, capacity=32)
    assert all(m.blocks is None for m in _dense(model.decoder))
    assert gb.pack_lossless(model.decoder.lm_head.weight) is None
    assert len(_greedy(model, 4)) == 4


def test_float32_model_upcast_from_bf16_keeps_only_its_float32_weights():
    """A float32 model whose values are bf16 (transformers loading a bf16 checkpoint in float32): no half copy is
    added beside the float32 weights by default (it would add half their bytes); asked for, it is exact."""
    hf = _half_model("bf16", tie=False).float()
    model = bitmtp.load(hf, adapter=None, capacity=64)
    dense = _dense(model.decoder)
    assert all(m.blocks is None and m.weight.dtype == torch.float32 for m in dense)
    head = model.decoder.lm_head
    before = logits(model.decoder)
    assert head.pack_blocks(gb.FORMATS).fmt == "bf16"
    model.decoder.invalidate_native()
    assert torch.equal(logits(model.decoder), before)


def test_quantize_ternary_keeps_the_half_embedding_and_head(monkeypatch):
    """quantize="ternary" on a bf16 checkpoint: projections ternary, embedding and LM head bf16 rows (no float32
    copy), logits equal to the same build on float32 weights bit for bit."""
    from bitmtp.ops import TernaryLinear

    hf = _half_model("bf16", tie=False)
    model = bitmtp.load(hf, adapter=None, capacity=64, quantize="ternary")
    dec = model.decoder
    assert dec.lm_head.lazy and dec.lm_head.blocks.fmt == "bf16" and dec.embed_blocks.fmt == "bf16"
    assert all(isinstance(lay.attn.o_proj, TernaryLinear) and isinstance(lay.mlp.down_proj, TernaryLinear)
               for lay in dec.layers)
    got = logits(dec), _greedy(model)
    monkeypatch.setenv("BITMTP_DENSE_BLOCKS", "0")
    plain = bitmtp.load(hf, adapter=None, capacity=64, quantize="ternary")
    assert plain.decoder.lm_head.blocks is None and plain.decoder.embed_blocks is None
    assert torch.equal(got[0], logits(plain.decoder)) and got[1] == _greedy(plain)

"""The ternary peer harness (bench/ternary_peer.py): the GGUF it writes is what llama.cpp's ``bitnet``
architecture loads (its tensor names and shapes, TQ2_0 projections, a Q8_0 tied embedding, a vocabulary with
the byte tokens llama.cpp looks up), bitmtp loads it as ternary layers, and bitmtp's side of each figure runs.
Running llama-bench on it is the full-mode benchmark's job (bench/e2e/test_bench_ternary_peer.py)."""

from __future__ import annotations

import pytest
import torch

from bench.ternary_peer import SHAPE, bitmtp_measure, decode_bytes, synthetic_vocab_fields, write_ternary_gguf

VOCAB = 700


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_ternary_gguf(tmp_path_factory.mktemp("ternary") / "t.gguf", layers=2, vocab=VOCAB, seed=3)


def test_the_file_has_llama_cpp_bitnet_tensors(gguf):
    from bitmtp.formats import gguf as G

    c = G.read_gguf(gguf)
    assert c.meta["general.architecture"] == "bitnet"
    t = c.tensors
    h, f = SHAPE["hidden"], SHAPE["ffn"]
    assert t["token_embd.weight"].type_name == "Q8_0" and tuple(t["token_embd.weight"].shape) == (VOCAB, h)
    for i in range(2):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            assert t[f"blk.{i}.{name}.weight"].type_name == "TQ2_0"
        assert tuple(t[f"blk.{i}.ffn_sub_norm.weight"].shape) == (f,)
        assert tuple(t[f"blk.{i}.attn_sub_norm.weight"].shape) == (h,)
    assert "output.weight" not in t  # tied: llama.cpp's bitnet graph reads the embedding as the output layer
    tokens = c.meta["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB and "<0x0A>" in tokens and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert len(c.meta["tokenizer.ggml.token_type"]) == len(c.meta["tokenizer.ggml.scores"]) == VOCAB


def test_bitmtp_loads_it_as_ternary_and_measures_each_figure(gguf):
    import bitmtp
    from bitmtp.ops.ternary_linear import TernaryLinear

    model = bitmtp.load(str(gguf), capacity=64, adapter=None)
    assert model.args.family == "bitnet" and model.args.num_layers == 2 and model.args.vocab_size == VOCAB
    assert all(isinstance(m, TernaryLinear) for m in (model.decoder.layers[0].attn.qkv_proj,
                                                      model.decoder.layers[1].mlp.down_proj))
    torch.set_num_threads(1)
    for figure in ("tg", "b2", "b8"):
        assert bitmtp_measure(model, figure, steps=4) > 0


def test_vocab_fields_and_decode_bytes():
    with pytest.raises(ValueError, match="260"):
        synthetic_vocab_fields(100)
    # 30 layers of 2.06-bit projections (~0.54 GB) plus the Q8_0 head (~0.35 GB)
    assert 0.85e9 < decode_bytes() < 0.92e9
    assert decode_bytes(context=1016) > decode_bytes(context=16)

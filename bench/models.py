"""Synthetic models for the benchmarks: BitNet b1.58-2B-4T shapes with random ternary weights.

The benchmarks measure cost, not quality, so random weights at the real shapes (hidden 2560,
intermediate 6912, 20 heads / 5 KV heads of 128, vocab 128256, tied dense LM head) stream exactly
the bytes the real model streams. ``layers`` and ``vocab`` shrink the model for quick mode.
"""

from __future__ import annotations

import torch

from bitmtp.formats import ggml_blocks as gb
from bitmtp.formats.ternary import words_per_row
from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import MLP, Attention, Decoder, Layer
from bitmtp.model.families import Norm
from bitmtp.model.layers import DenseLinear, LazyWeight
from bitmtp.ops import TernaryLinear

BITNET2B_LAYERS = 30
BITNET2B_VOCAB = 128256


def random_t2(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random T2 words with every 2-bit code in {0, 1, 2} (code 3 is folded to 1)."""
    w = torch.randint(0, 2**32, (n, words_per_row(k)), generator=g, dtype=torch.int64)
    w &= ~((w & (w >> 1) & 0x55555555) << 1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def bitnet2b_decoder(layers: int = BITNET2B_LAYERS, seed: int = 0, vocab: int = BITNET2B_VOCAB,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     embed_rows: str | None = None) -> Decoder:
    """A decoder with BitNet-2B shapes and random ternary weights (``layers`` of them, ``vocab`` rows of
    the tied embedding / LM head in ``dtype``), built on the CPU and moved to ``device``.

    ``embed_rows="bf16"``: the embedding / LM head as the real checkpoint holds it and ``bitmtp.load`` keeps it
    for the CPU — bfloat16 rows (a lazy ``bf16`` block weight, no float32 copy); the default is float32 values
    (the layout of every earlier BitNet-shape figure)."""
    a = ModelArgs(family="bitnet", vocab_size=vocab, hidden_size=2560, num_layers=layers, num_heads=20,
                  num_kv_heads=5, head_dim=128, intermediate_size=6912,
                  tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(seed)

    def tl(n: int, k: int) -> TernaryLinear:
        return TernaryLinear(k, n, random_t2(n, k, g), torch.rand(1, 1, generator=g) * 0.05 + 0.01)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    blocks = []
    for _ in range(layers):
        attn = Attention(a, tl(a.q_size, 2560), tl(a.kv_size, 2560), tl(a.kv_size, 2560), tl(2560, a.q_size))
        mlp = MLP(a, tl(6912, 2560), tl(6912, 2560), tl(2560, 6912))
        norms = {Norm.ATTN_IN: ones(2560), Norm.ATTN_SUB: ones(a.q_size), Norm.MLP_IN: ones(2560),
                 Norm.MLP_SUB: ones(6912)}
        blocks.append(Layer(a, attn, mlp, norms))
    embed = (torch.randn(a.vocab_size, 2560, generator=g) * 0.02).to(dtype)
    if embed_rows == "bf16":
        lazy = LazyWeight(gb.from_half(embed.to(torch.bfloat16)))
        decoder = Decoder(a, lazy, blocks, ones(2560), DenseLinear(None, blocks=lazy), max_positions=1024)
        return decoder.to(device) if torch.device(device).type != "cpu" else decoder
    if embed_rows is not None:
        raise ValueError(f"embed_rows: expected None or 'bf16', got {embed_rows!r}")
    decoder = Decoder(a, embed, blocks, ones(2560), DenseLinear(embed), max_positions=1024)
    return decoder.to(device) if torch.device(device).type != "cpu" else decoder


SMOLLM2_LAYERS = 30


def gguf_like(n: int, k: int, fmt: str, g: torch.Generator) -> torch.Tensor:
    """A float32 ``[n, k]`` weight that came from ``fmt`` blocks (random codes and scales, dequantized
    as gguf-py does), so :meth:`Decoder.pack_dense_blocks` finds its blocks — like SmolLM2's GGUF."""
    b = k // gb.BLOCK
    d = (torch.rand(n, b, generator=g) * 0.02 + 0.002).half().float()
    if fmt == "q4_1":
        q = torch.randint(0, 16, (n, k), generator=g)
        q.view(n, b, gb.BLOCK)[..., :2] = torch.tensor([0, 15])  # a quantizer's block spans its range
        return gb.dequantize(gb.pack(fmt, q, d, (-7.5 * d).half().float()))
    q = torch.randint(-127, 128, (n, k), generator=g)
    q.view(n, b, gb.BLOCK)[..., 0] = 127
    return gb.dequantize(gb.pack(fmt, q, d))


def smollm2_shaped_decoder(layers: int = SMOLLM2_LAYERS, seed: int = 0, blocks: bool = False) -> Decoder:
    """A dense float32 decoder with SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 heads over 3
    KV heads of 64, vocab 49152, tied LM head) and random weights: the small-model case where a CPU
    step's cost is per-op dispatch as much as bytes. ``blocks``: weights as in SmolLM2's GGUF (Q4_1
    projections, Q8_0 embedding and tied head), packed (``DenseLinear.blocks``)."""
    a = ModelArgs(family="llama", vocab_size=49152, hidden_size=576, num_layers=layers, num_heads=9, num_kv_heads=3,
                  head_dim=64, intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0,
                  max_position_embeddings=2048)
    g = torch.Generator().manual_seed(seed)

    def dl(n: int, k: int) -> DenseLinear:
        if blocks:
            return DenseLinear(gguf_like(n, k, "q4_1", g))
        return DenseLinear(torch.randn(n, k, generator=g) * k**-0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    layer_list = []
    for _ in range(layers):
        attn = Attention(a, dl(a.q_size, 576), dl(a.kv_size, 576), dl(a.kv_size, 576), dl(576, a.q_size))
        mlp = MLP(a, dl(1536, 576), dl(1536, 576), dl(576, 1536))
        attn_in, mlp_in = norm(576), norm(576)
        layer_list.append(Layer(a, attn, mlp, {Norm.ATTN_IN: attn_in, Norm.MLP_IN: mlp_in}))
    embed = gguf_like(a.vocab_size, 576, "q8_0", g) if blocks else torch.randn(a.vocab_size, 576, generator=g) * 0.05
    dec = Decoder(a, embed, layer_list, norm(576), DenseLinear(embed), max_positions=1024)
    if blocks:
        stats = dec.pack_dense_blocks()
        assert "float" not in stats["formats"], stats
    return dec


def streamed_bytes(decoder: Decoder) -> tuple[int, int]:
    """``(ternary bytes, LM-head bytes)`` one decode step reads: packed weights + scales, dense head."""
    ternary = sum(m.weight.numel() * 4 + m.scales.numel() * 4
                  for m in decoder.modules() if isinstance(m, TernaryLinear))
    head = decoder.lm_head.weight.numel() * decoder.lm_head.weight.element_size()
    return ternary, head


_SHARED: dict[tuple[int, int, int], Decoder] = {}


def shared_bitnet2b_decoder(layers: int = BITNET2B_LAYERS, seed: int = 0, vocab: int = BITNET2B_VOCAB) -> Decoder:
    """A CPU :func:`bitnet2b_decoder` built once per session and shared by the benchmark modules (the
    30-layer one takes seconds to build and gigabytes to hold; engines own the KV, not the decoder)."""
    key = (layers, seed, vocab)
    if key not in _SHARED:
        _SHARED.clear()  # hold one at a time
        _SHARED[key] = bitnet2b_decoder(layers, seed, vocab)
    return _SHARED[key]


def step_runners(decoder: Decoder, block: int = 8, prompt: list[int] | None = None):
    """``(engine, runners)``: an engine prefilled with ``prompt`` (64 tokens by default) and the static-
    buffer runners of an AR step (width 1), a verify step (width D) and a mask-block draft step (width
    2D − 1, a random non-zero adapter), their inputs filled with random tokens at the next positions —
    what the step benchmarks time."""
    from bitmtp.decoding.drafters import MaskBlockDrafter
    from bitmtp.formats.adapters import AdapterConfig, BaseShape
    from bitmtp.model.adapters import MaskBlock, init_adapter_tensors
    from bitmtp.runtime import Engine, ReplayState

    eng = Engine(decoder, capacity=512, m_max=2 * block)
    eng.prefill(prompt or list(range(100, 164)))
    n = eng.n
    seg = eng.kv.segment_for(n + 2 * block)
    cfg = AdapterConfig("mask-block", block, 8, BaseShape.of(decoder.args))
    eng.pool.set_drafter(MaskBlockDrafter(decoder, MaskBlock(cfg, init_adapter_tensors(cfg, zero_init_b=False))))
    runners = {"ar": eng.pool.get(ReplayState(1, seg, "ar")),
               f"verify{block}": eng.pool.get(ReplayState(block, seg, "verify")),
               f"draft{2 * block - 1}": eng.pool.get(ReplayState(2 * block - 1, seg, "draft", block))}
    for r in runners.values():
        r.tokens.copy_(torch.randint(100, 1000, r.tokens.shape))
        torch.arange(n, n + r.tokens.numel(), out=r.positions)
    return eng, runners

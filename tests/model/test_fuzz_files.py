"""Corrupt model files, fuzzed (issue 21): every load ends in a BitMTPError or a correct model, never another
exception, a hang, a MemoryError or a crash.

What counts as correct, per mutation (the original file's model is the reference):

GGUF (a tiny llama with a packed adapter, dense F32; and a ternary one stored as Q4_0 + exact scales)
  * truncation anywhere (every section boundary ±1: header, each metadata entry's parts, each tensor info's
    parts, the alignment padding, each tensor's data; and random offsets): FormatError, always.
  * a header field (string length, array count, dimension count, dimension, data offset, value / item /
    tensor type tag) set to a random value, or a random byte of the header flipped: BitMTPError, or a model
    whose logits on a fixed prompt are bit-identical to the original's. One exception: a tensor type tag
    replaced by a type with the same block and byte size (F32 → I32, Q4_0 → IQ4_NL) reinterprets the same
    bytes; there a model that loads and runs is acceptable too.
  * a random byte of the data section flipped: BitMTPError, or a model that loads and generates without
    an exception (a flipped weight byte can decode to another finite weight, which no check can see).
safetensors folder
  * truncation, a header-length field set to a random value, a tensor's dtype or shape changed in the
    header, NaN/Inf in a weight: BitMTPError, always.
  * a random byte of the header JSON flipped: BitMTPError, or logits identical to the original's.
  * config.json with a field set to a random JSON value or deleted: BitMTPError, or logits equal (1e-4) to
    transformers' on the same folder — or, where transformers itself refuses the config, identical to the
    original's (the field is one bitmtp does not read).
adapter folder
  * truncated adapter.safetensors, a tensor of another shape, NaN/Inf in a tensor: BitMTPError, always.
  * adapter_config.json with a field set to a random JSON value or deleted: BitMTPError, or the adapter loads
    with the tensors unchanged and the field equal to what the file now says (or its default when deleted).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import bitmtp
from bitmtp.errors import BitMTPError, FormatError
from bitmtp.formats.adapters import CONFIG_FILE, TENSOR_FILE, AdapterConfig, load_adapter
from bitmtp.model.gguf_io import read_model
from bitmtp.model.loaders import from_safetensors_dir
from tests.support.model_files import PROMPT, field_offsets, logits

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("no_dynamo")

FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)


class _Ref(dict):
    """Reference data of a fuzzed file; a short repr, since hypothesis prints fixtures of failing examples."""

    def __repr__(self) -> str:
        return f"<reference data: {sorted(self)}>"


def _load_gguf(path: Path):
    """The decoder of ``path``, or None on a BitMTPError (any other exception fails the test)."""
    try:
        return read_model(path, max_positions=64).decoder
    except BitMTPError:
        return None


@pytest.fixture(scope="module")
def gguf_files(gguf_dense, gguf_ternary):  # noqa: F811
    """name -> (path, bytes, reference logits, header layout)."""
    out = {}
    for name, path in (("dense", gguf_dense), ("q4_0", gguf_ternary["Q4_0"])):
        r = gguf.GGUFReader(str(path))
        out[name] = _Ref(path=path, data=path.read_bytes(), ref=logits(read_model(path).decoder),
                         fields=field_offsets(path), data_start=int(r.data_offset),
                         tensors=[(int(t.data_offset), int(t.n_bytes)) for t in r.tensors])
    return out


def _write(tmp: Path, data: bytes | bytearray) -> Path:
    tmp.write_bytes(bytes(data))
    return tmp


# --------------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dense", "q4_0"])
def test_gguf_truncated_at_every_section_boundary(name, gguf_files, tmp_path):
    f = gguf_files[name]
    size = len(f["data"])
    cuts = {0, 4, 8, 16, 24, f["data_start"], f["data_start"] - 1}
    for parts in f["fields"].values():
        for _part, off, n in parts:
            cuts |= {off, off + 1, off + n - 1, off + n}
    for off, n in f["tensors"]:
        cuts |= {off - 1, off, off + 1, off + n // 2, off + n - 1}
    cuts = sorted(c for c in cuts if 0 <= c < size)
    assert len(cuts) > 200  # every entry of a 30-tensor, 25-key file
    for cut in cuts:
        with pytest.raises(FormatError):
            read_model(_write(tmp_path / "t.gguf", f["data"][:cut]))


@settings(FUZZ, max_examples=25)
@given(name=st.sampled_from(["dense", "q4_0"]), frac=st.floats(0, 1, exclude_max=True))
def test_gguf_truncated_at_random(name, frac, gguf_files, tmp_path_factory):
    f = gguf_files[name]
    cut = int(frac * len(f["data"]))
    with pytest.raises(FormatError):
        read_model(_write(tmp_path_factory.mktemp("t") / "t.gguf", f["data"][:cut]))


_FIELD_WIDTH = {"key_len": 8, "value_len": 8, "count": 8, "name_len": 8, "offset": 8, "dims": 8, "n_dims": 4,
                "type": 4, "array_type": 4, "ttype": 4}


def _header_fields(f) -> list[tuple[str, int, int]]:
    return [(part, off, n) for parts in f["fields"].values() for part, off, n in parts if part in _FIELD_WIDTH]


@settings(FUZZ, max_examples=60)
@given(name=st.sampled_from(["dense", "q4_0"]), pick=st.integers(0, 10**6), dim=st.integers(0, 3),
       value=st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**32 - 1, 2**60]),
                       st.integers(-8, 8).map(lambda d: ("delta", d))))
def test_gguf_header_field_set_to_random_value(name, pick, dim, value, gguf_files, tmp_path_factory):
    f = gguf_files[name]
    part, off, n = _header_fields(f)[pick % len(_header_fields(f))]
    width = _FIELD_WIDTH[part]
    if part == "dims":  # one dimension of the tensor's shape
        off += 8 * (dim % (n // 8))
    data = bytearray(f["data"])
    old = int.from_bytes(data[off:off + width], "little")
    new = (old + value[1]) if isinstance(value, tuple) else value
    new %= 2 ** (8 * width)
    data[off:off + width] = new.to_bytes(width, "little")
    dec = _load_gguf(_write(tmp_path_factory.mktemp("h") / "h.gguf", data))
    if dec is None:
        return
    out = logits(dec)
    if part == "ttype" and new != old:  # the same bytes read as a type of the same block/byte size
        q = gguf.GGMLQuantizationType
        assert gguf.GGML_QUANT_SIZES[q(new)] == gguf.GGML_QUANT_SIZES[q(old)], (part, old, new)
        return
    assert torch.equal(out, f["ref"]), (part, off, old, new)


@settings(FUZZ, max_examples=60)
@given(name=st.sampled_from(["dense", "q4_0"]), frac=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_gguf_header_byte_flipped(name, frac, mask, gguf_files, tmp_path_factory):
    f = gguf_files[name]
    at = int(frac * f["data_start"])
    data = bytearray(f["data"])
    data[at] ^= mask
    dec = _load_gguf(_write(tmp_path_factory.mktemp("b") / "b.gguf", data))
    if dec is not None:
        assert torch.equal(logits(dec), f["ref"]), at


@settings(FUZZ, max_examples=25)
@given(name=st.sampled_from(["dense", "q4_0"]), frac=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255),
       flips=st.integers(1, 4))
def test_gguf_data_bytes_flipped(name, frac, mask, flips, gguf_files, tmp_path_factory):
    f = gguf_files[name]
    start, size = f["data_start"], len(f["data"])
    data = bytearray(f["data"])
    for i in range(flips):  # neighbouring bytes: a weight's exponent, a block's scale and codes
        data[min(start + int(frac * (size - start)) + i, size - 1)] ^= mask
    path = _write(tmp_path_factory.mktemp("d") / "d.gguf", data)
    try:
        model = bitmtp.load(path, adapter="auto", capacity=64)
    except BitMTPError:
        return
    out = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=4, policy="ar")
    assert len(out.token_ids) <= 4


def test_gguf_block_scale_flips_are_caught(gguf_files, tmp_path):
    """The common case of random bytes in block data: a scale that decodes to Inf/NaN is always an error.
    Every block's ``d`` of one Q4_0 ternary tensor set in turn to each non-finite float16 class."""
    f = gguf_files["q4_0"]
    off, n = next((o, n) for o, n in f["tensors"] if n % 18 == 0 and n >= 18 * 8)
    for block in range(0, n // 18, 7):
        for bits in (b"\x00\x7c", b"\x01\x7e", b"\xff\xff", b"\x00\xfc"):
            data = bytearray(f["data"])
            data[off + 18 * block:off + 18 * block + 2] = bits
            with pytest.raises(FormatError, match="non-finite float16 scale"):
                read_model(_write(tmp_path / "s.gguf", data))


# --------------------------------------------------------------------------------------------------
# safetensors folders
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def st_ref(ckpt):  # noqa: F811
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    hlen = struct.unpack("<Q", data[:8])[0]
    return _Ref(ckpt=ckpt, data=data, hlen=hlen, header=json.loads(data[8:8 + hlen]),
                ref=logits(from_safetensors_dir(ckpt)), config=json.loads((ckpt / "config.json").read_text()))


def _folder(st_ref, tmp: Path, tensors: bytes | None = None, config=None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "model.safetensors").write_bytes(st_ref["data"] if tensors is None else tensors)
    (tmp / "config.json").write_text(json.dumps(st_ref["config"] if config is None else config))
    return tmp


def _load_dir(path: Path):
    try:
        return from_safetensors_dir(path)
    except BitMTPError:
        return None


@settings(FUZZ, max_examples=20)
@given(frac=st.floats(0, 1, exclude_max=True))
def test_safetensors_truncated(frac, st_ref, tmp_path_factory):
    cut = int(frac * len(st_ref["data"]))
    with pytest.raises(FormatError, match="model.safetensors"):
        from_safetensors_dir(_folder(st_ref, tmp_path_factory.mktemp("s"), st_ref["data"][:cut]))


@settings(FUZZ, max_examples=20)
@given(value=st.one_of(st.integers(0, 2**64 - 1), st.integers(-16, 16).map(lambda d: ("delta", d))))
def test_safetensors_header_length_field(value, st_ref, tmp_path_factory):
    new = (st_ref["hlen"] + value[1]) if isinstance(value, tuple) else value
    if new == st_ref["hlen"]:
        return
    data = struct.pack("<Q", new % 2**64) + st_ref["data"][8:]
    with pytest.raises(FormatError, match="model.safetensors"):
        from_safetensors_dir(_folder(st_ref, tmp_path_factory.mktemp("s"), data))


@settings(FUZZ, max_examples=40)
@given(frac=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_safetensors_header_byte_flipped(frac, mask, st_ref, tmp_path_factory):
    data = bytearray(st_ref["data"])
    data[8 + int(frac * st_ref["hlen"])] ^= mask
    dec = _load_dir(_folder(st_ref, tmp_path_factory.mktemp("s"), bytes(data)))
    if dec is not None:
        assert torch.equal(logits(dec), st_ref["ref"])


def _with_header(st_ref, header: dict) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + st_ref["data"][8 + st_ref["hlen"]:]


@settings(FUZZ, max_examples=20)
@given(pick=st.integers(0, 10**6), change=st.sampled_from(["F16", "BF16", "I32", "F64", "U8", "shape", "swap"]))
def test_safetensors_dtype_or_shape_mismatch(pick, change, st_ref, tmp_path_factory):
    header = json.loads(json.dumps(st_ref["header"]))
    names = sorted(k for k in header if k != "__metadata__")
    info = header[names[pick % len(names)]]
    if change == "shape":
        info["shape"] = [info["shape"][0] + 1] + info["shape"][1:]
    elif change == "swap":
        if len(info["shape"]) != 2 or info["shape"][0] == info["shape"][1]:
            info["shape"] = info["shape"] + [1]
        else:
            info["shape"] = info["shape"][::-1]
    else:
        if info["dtype"] == change:
            return
        info["dtype"] = change
    with pytest.raises(BitMTPError):
        from_safetensors_dir(_folder(st_ref, tmp_path_factory.mktemp("s"), _with_header(st_ref, header)))


@settings(FUZZ, max_examples=15)
@given(pick=st.integers(0, 10**6), at=st.floats(0, 1, exclude_max=True),
       value=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_safetensors_non_finite(pick, at, value, st_ref, tmp_path_factory):
    folder = _folder(st_ref, tmp_path_factory.mktemp("s"))
    t = load_file(str(folder / "model.safetensors"))
    name = sorted(t)[pick % len(t)]
    t[name].view(-1)[int(at * t[name].numel())] = value
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(FormatError, match=f"tensor {name!r} holds a non-finite value"):
        from_safetensors_dir(folder)


@settings(FUZZ, max_examples=10)
@given(pick=st.integers(0, 10**6), value=st.one_of(st.just("<delete>"), JSON_VALUES))
def test_config_json_mutated(pick, value, st_ref, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    cfg = dict(st_ref["config"])
    key = sorted(cfg)[pick % len(cfg)]
    if value == "<delete>":
        del cfg[key]
    else:
        cfg[key] = value
    folder = _folder(st_ref, tmp_path_factory.mktemp("c"), config=cfg)
    dec = _load_dir(folder)
    if dec is None:
        return
    ours = logits(dec)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False).float().eval()
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT])).logits[0].float()
    except Exception:  # transformers refuses the config: then bitmtp must not have read the field at all
        assert torch.equal(ours, st_ref["ref"]), (key, value)
        return
    assert (ours - ref).abs().max().item() <= 1e-4, (key, value)


# --------------------------------------------------------------------------------------------------
# adapter folders
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ad_ref(adapter_dir):  # noqa: F811
    cfg, tensors = load_adapter(adapter_dir)
    return _Ref(raw=json.loads((adapter_dir / CONFIG_FILE).read_text()),
                data=(adapter_dir / TENSOR_FILE).read_bytes(), tensors=tensors, config=cfg)


def _adapter_folder(ad_ref, tmp: Path, raw=None, data: bytes | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(ad_ref["raw"] if raw is None else raw))
    (tmp / TENSOR_FILE).write_bytes(ad_ref["data"] if data is None else data)
    return tmp


@settings(FUZZ, max_examples=15)
@given(frac=st.floats(0, 1, exclude_max=True))
def test_adapter_truncated(frac, ad_ref, tmp_path_factory):
    data = ad_ref["data"][:int(frac * len(ad_ref["data"]))]
    with pytest.raises(FormatError, match=TENSOR_FILE):
        load_adapter(_adapter_folder(ad_ref, tmp_path_factory.mktemp("a"), data=data))


_DEFAULTS = {k: f.default for k, f in AdapterConfig.__dataclass_fields__.items()}


@settings(FUZZ, max_examples=40)
@given(pick=st.integers(0, 10**6), value=st.one_of(st.just("<delete>"), JSON_VALUES, st.integers(-2, 20)))
def test_adapter_config_mutated(pick, value, ad_ref, tmp_path_factory):
    raw = dict(ad_ref["raw"])
    key = sorted(raw)[pick % len(raw)]
    if value == "<delete>":
        del raw[key]
    else:
        raw[key] = value
    folder = _adapter_folder(ad_ref, tmp_path_factory.mktemp("a"), raw=raw)
    try:
        cfg, tensors = load_adapter(folder)
    except BitMTPError:
        return
    assert tensors.keys() == ad_ref["tensors"].keys()
    assert all(torch.equal(tensors[k], v) for k, v in ad_ref["tensors"].items())
    got = getattr(cfg, key)
    if value == "<delete>":
        assert key == "targets" or got == _DEFAULTS[key], key
    else:  # the field took the file's value (an integer where a float is expected compares equal)
        assert got == value, (key, value, got)


@settings(FUZZ, max_examples=15)
@given(pick=st.integers(0, 10**6), grow=st.integers(-2, 2).filter(lambda g: g != 0), axis=st.integers(0, 1))
def test_adapter_tensor_wrong_shape(pick, grow, axis, ad_ref, tmp_path_factory):
    folder = _adapter_folder(ad_ref, tmp_path_factory.mktemp("a"))
    t = dict(ad_ref["tensors"])
    name = sorted(t)[pick % len(t)]
    shape = list(t[name].shape)
    axis = axis % len(shape)
    shape[axis] = max(1, shape[axis] + grow) if shape[axis] + grow > 0 else shape[axis] + 1
    t[name] = torch.randn(shape)
    save_file(t, str(folder / TENSOR_FILE))
    with pytest.raises(BitMTPError, match=name.replace(".", r"\.")):
        load_adapter(folder)


@settings(FUZZ, max_examples=15)
@given(pick=st.integers(0, 10**6), at=st.floats(0, 1, exclude_max=True),
       value=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_adapter_non_finite(pick, at, value, ad_ref, tmp_path_factory):
    folder = _adapter_folder(ad_ref, tmp_path_factory.mktemp("a"))
    t = {k: v.clone() for k, v in ad_ref["tensors"].items()}
    name = sorted(t)[pick % len(t)]
    t[name].view(-1)[int(at * t[name].numel())] = value
    save_file(t, str(folder / TENSOR_FILE))
    with pytest.raises(FormatError, match=f"tensor {name!r} holds a non-finite value"):
        load_adapter(folder)


def test_fuzz_inputs_are_not_trivial(gguf_files):
    """The fuzzed files are what the rules above assume: a 30-tensor GGUF whose reference logits vary."""
    f = gguf_files["dense"]
    assert len(f["tensors"]) >= 30 and f["ref"].std() > 0 and len(np.unique(f["ref"].argmax(-1))) > 1

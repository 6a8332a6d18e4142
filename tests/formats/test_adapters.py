"""Adapter files: round trip, validation naming the field or tensor, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bitmtp.errors import BitMTPError, FormatError, ShapeError
from bitmtp.formats.adapters import CONFIG_FILE, TENSOR_FILE, AdapterConfig, BaseShape, load_adapter, save_adapter
from bitmtp.model.args import ModelArgs

ARGS = ModelArgs(family="llama", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96)


def _random(config: AdapterConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.randn(*shape, generator=g) for k, shape in config.expected_shapes().items()}


@pytest.mark.parametrize("kind,d", [("mask-block", 8), ("heads", 4), ("mask-block", 2), ("heads", 16)])
def test_round_trip(kind, d, tmp_path, rng):
    cfg = AdapterConfig(kind=kind, block_size=d, rank=5, base=BaseShape.of(ARGS), targets=["q", "v", "down"])
    tensors = _random(cfg, rng)
    save_adapter(tmp_path / "ad", cfg, tensors)
    cfg2, t2 = load_adapter(tmp_path / "ad")
    assert cfg2 == cfg
    assert t2.keys() == tensors.keys() and all(torch.equal(t2[k], tensors[k]) for k in tensors)
    cfg2.check_base(ARGS)
    if kind == "heads":
        assert len([k for k in t2 if k.endswith(".up")]) == d - 1
    else:
        assert t2["layers.1.down.lora_A"].shape == (5, 96) and t2["layers.0.v.lora_B"].shape == (32, 5)


def test_base_mismatch_names_the_field(rng):
    cfg = AdapterConfig(kind="heads", block_size=4, rank=3, base=BaseShape.of(ARGS))
    other = ModelArgs(**{**ARGS.to_dict(), "num_layers": 3})
    with pytest.raises(FormatError, match="base.num_layers"):
        cfg.check_base(other)


@pytest.mark.parametrize("field,value,needle", [("kind", "lora", "kind"), ("block_size", 17, "block_size"),
                                                 ("block_size", 1, "block_size"), ("rank", 0, "rank"),
                                                 ("targets", ["q", "qq"], "targets"),
                                                 ("discount_gamma", 0.0, "discount_gamma")])
def test_bad_config_fields(field, value, needle):
    kwargs = dict(kind="mask-block", block_size=8, rank=4, base=BaseShape.of(ARGS))
    kwargs[field] = value
    with pytest.raises(FormatError, match=needle):
        AdapterConfig(**kwargs)


def test_bad_files(tmp_path, rng):
    cfg = AdapterConfig(kind="mask-block", block_size=8, rank=4, base=BaseShape.of(ARGS), targets=["q"])
    path = save_adapter(tmp_path / "ad", cfg, _random(cfg, rng))
    with pytest.raises(BitMTPError, match="already exists"):
        save_adapter(path, cfg, _random(cfg, rng))
    save_adapter(path, cfg, _random(cfg, rng), overwrite=True)  # replaced atomically
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]  # no temporary folders left behind

    t = load_file(str(path / TENSOR_FILE))
    t["layers.0.q.lora_A"] = torch.zeros(4, 63)
    save_file(t, str(path / TENSOR_FILE))
    with pytest.raises(ShapeError, match="layers.0.q.lora_A"):
        load_adapter(path)
    t.pop("layers.0.q.lora_A")
    save_file(t, str(path / TENSOR_FILE))
    with pytest.raises(FormatError, match="missing tensor 'layers.0.q.lora_A'"):
        load_adapter(path)

    data = (path / TENSOR_FILE).read_bytes()
    (path / TENSOR_FILE).write_bytes(data[: len(data) // 3])
    with pytest.raises(FormatError, match="truncated"):
        load_adapter(path)
    raw = json.loads((path / CONFIG_FILE).read_text())
    raw["block_size"] = 40
    (path / CONFIG_FILE).write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="block_size"):
        load_adapter(path)
    with pytest.raises(FormatError, match="not an adapter folder"):
        load_adapter(tmp_path)


def test_failed_write_leaves_nothing(tmp_path, rng):
    cfg = AdapterConfig(kind="heads", block_size=3, rank=2, base=BaseShape.of(ARGS))
    bad = _random(cfg, rng)
    bad["heads.0.up"] = torch.zeros(1)
    with pytest.raises(ShapeError):
        save_adapter(tmp_path / "ad", cfg, bad)
    assert list(tmp_path.iterdir()) == []

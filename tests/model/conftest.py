"""Model files shared by tests/model/test_load_validation.py and tests/model/test_fuzz_files.py, written once
per test module (module scope) from the tiny random models of tests/support/hf_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import bitmtp
from bitmtp.formats.adapters import AdapterConfig, BaseShape, save_adapter
from bitmtp.model.adapters import init_adapter_tensors
from tests.support.hf_models import tiny_model
from tests.support.model_files import ARGS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny llama checkpoint folder (config.json + model.safetensors), written once per module."""
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model("llama", seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gguf_dense(tmp_path_factory) -> Path:
    """A tiny llama exported to GGUF with dense F32 projections and a packed mask-block adapter."""
    path = tmp_path_factory.mktemp("gguf") / "dense.gguf"
    model = bitmtp.load(tiny_model("llama", seed=4), adapter=None)
    cfg = AdapterConfig(kind="mask-block", block_size=4, rank=2, base=BaseShape.of(model.args), targets=["q", "up"])
    model.load_adapter((cfg, init_adapter_tensors(cfg, seed=1, zero_init_b=False, b_std=0.2)))
    return model.save_gguf(path, progress=False)


@pytest.fixture(scope="module")
def gguf_ternary(tmp_path_factory) -> dict[str, Path]:
    """Tiny ternary models whose projections are stored as Q4_0 (K = 64) and TQ2_0 (K = 256), with exact scales."""
    out = {}
    for kind, hidden in (("Q4_0", 64), ("TQ2_0", 256)):
        model = bitmtp.load(tiny_model("llama", seed=5, hidden_size=hidden, intermediate_size=2 * hidden),
                            quantize="ternary", adapter=None)
        out[kind] = model.save_gguf(tmp_path_factory.mktemp("gguf") / f"{kind}.gguf", progress=False)
    return out


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A saved mask-block adapter (targets q and down, lora_alpha 6) for a model of ``ARGS``'s shape."""
    cfg = AdapterConfig(kind="mask-block", block_size=8, rank=3, base=BaseShape.of(ARGS), targets=["q", "down"],
                        lora_alpha=6.0)
    return save_adapter(tmp_path_factory.mktemp("ad") / "ad", cfg, init_adapter_tensors(cfg, seed=2, zero_init_b=False))

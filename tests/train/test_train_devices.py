"""Training an adapter on each device the runtime decodes on: the loss falls, the adapter file loads back, and
decoding with it stays exact (speculative == AR). The ``cuda`` case runs in bench/gpu_check.sh's ``-m cuda`` step
— the route to more training data and longer runs than a CPU affords (issue "MTP that pays", item 3) starts
there — and this file's CPU case checks the same code here.

Rules: greedy token-by-token equality for decoding; the loss criterion as tests/train/test_train.py's."""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.formats.adapters import load_adapter
from bitmtp.train import TrainConfig, train
from tests.support.adapters import INIT_RANGE
from tests.support.hf_models import tiny_model
from tests.support.training import periodic_windows

pytest.importorskip("transformers")

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run bench/gpu_check.sh on one)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["mask-block", "heads"])
def test_train_on_device_then_decode_exactly(device, mode, tmp_path):
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    model = bitmtp.load(hf, capacity=256, device=device, adapter=None)
    assert model.decoder.device.type == device
    windows = periodic_windows()
    cfg = TrainConfig(out=str(tmp_path / "ad"), mode=mode, block_size=4, rank=4, max_steps=40, lr=1e-2, anchors=8,
                      self_distill=False, seed=3, save_dtype="float32", data_description="synthetic")
    res = train(model.decoder, windows, cfg, progress=False)
    assert all(torch.isfinite(torch.tensor(res.losses)))
    assert sum(res.losses[-5:]) / 5 < 0.8 * sum(res.losses[:5]) / 5
    config, _ = load_adapter(res.path)
    assert config.kind == mode and config.training["steps"] == 40
    model.load_adapter(res.path)
    prompt = windows[5][:12]
    ar = bitmtp.generate(model, input_ids=prompt, max_new_tokens=24, policy="ar", eos_token_id=[]).token_ids
    for policy in ("speculative", "auto"):
        got = bitmtp.generate(model, input_ids=prompt, max_new_tokens=24, policy=policy, block_size=4,
                              eos_token_id=[])
        assert got.token_ids == ar, policy

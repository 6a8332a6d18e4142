"""The ``full`` training mode (bitmtp/train/full.py): joint NTP + MTP fine-tune of every weight.

Rules: step 0 is the base model (each ternary latent re-ternarizes to the checkpoint's own codes,
exactly, and scales within float32 rounding, rtol 1e-6); the joint loss falls on a fixed seed;
gradients reach every kind of weight through the straight-through estimator; the written GGUF
loads with its adapter (a mask embedding without LoRA), equals the in-memory trained decoder token
for token, and decodes losslessly with ``speculative``; bad input raises BitMTPError.
"""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.formats.quantize import absmean_ternarize
from bitmtp.ops import TernaryLinear
from bitmtp.train import TrainConfig, train
from bitmtp.train.full import FullParams, full_loss, initial_latent, scale_layout
from tests.support.hf_models import tiny_model
from tests.support.training import periodic_windows

pytest.importorskip("transformers")


def _load(family="llama", quantize="ternary", seed=3, **over):
    return bitmtp.load(tiny_model(family, seed=seed, initializer_range=0.3, **over), capacity=256,
                       quantize=quantize, adapter=None)


def _ternary_modules(decoder):
    for layer in decoder.layers:
        for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if isinstance(m, TernaryLinear):
                yield m


@pytest.mark.parametrize("granularity", ["tensor", "row", "group"])
def test_initial_latent_reproduces_the_checkpoint(granularity):
    torch.manual_seed(0)
    lin = torch.nn.Linear(80, 37)  # K, N not powers of two; K = 5 groups of 16
    mod = TernaryLinear.from_float(lin, granularity=granularity, group_size=16 if granularity == "group" else None)
    latent = initial_latent(mod)
    assert scale_layout(mod)[0] == granularity
    q, a = absmean_ternarize(latent, *scale_layout(mod))
    assert torch.equal(q, mod.ternary_weight())
    torch.testing.assert_close(a, mod.scales, rtol=1e-6, atol=0)


def test_initial_latent_of_a_model():
    m = _load("bitnet", "ternary")
    mods = list(_ternary_modules(m.decoder))
    assert mods
    for mod in mods:
        q, a = absmean_ternarize(initial_latent(mod), *scale_layout(mod))
        assert torch.equal(q, mod.ternary_weight())
        torch.testing.assert_close(a, mod.scales, rtol=1e-6, atol=0)


def test_step_zero_is_the_base_model():
    m = _load()
    params = FullParams(m.decoder, m.decoder.embed.mean(0))
    tokens = torch.tensor([periodic_windows(n=1, length=40)[0]])
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None]
    from bitmtp.train.forward import TrainView

    frozen = TrainView(m.decoder).logits(TrainView(m.decoder).hidden(m.decoder.embed[tokens], torch.arange(40), causal))
    ours = params.view.logits(params.view.hidden(params.view.embed[tokens], torch.arange(40), causal))
    torch.testing.assert_close(ours, frozen, rtol=1e-4, atol=1e-4)


def test_gradients_reach_every_weight_kind():
    m = _load("qwen3", "ternary")  # q/k norms too
    params = FullParams(m.decoder, m.decoder.embed.mean(0))
    tokens = torch.tensor(periodic_windows(n=2, length=32))
    loss, _ = full_loss(params.view, params, tokens, [3, 10, 20], 4, 0.8, self_distill=False)
    loss.backward()
    named = dict(params.named_parameters())
    for key in ("mask_embedding", "view.embed", "view.norm", "view.layers.0.qkv.weight", "view.layers.1.down.weight",
                "view.layers.0.norm_q", "view.layers.1.norm_attn_in", "view.layers.1.norm_mlp_in"):
        g = named[key].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, key


def test_short_blocks_in_the_joint_loss():
    """Short blocks (one mask row) in the full mode: blocks never see each other and the NTP term is the
    same, so loss(full + short) · 8 == loss(full) · 3 + loss(short) · 5 (float32, rtol 1e-5)."""
    m = _load()
    params = FullParams(m.decoder, m.decoder.embed.mean(0))
    tokens = torch.tensor(periodic_windows(n=2, length=32))
    full, short = [2, 11, 20], [0, 4, 11, 25, 29]
    with torch.no_grad():
        both, acc = full_loss(params.view, params, tokens, full + short, 4, 0.8, True, widths=[3] * 3 + [1] * 5)
        f, acc_f = full_loss(params.view, params, tokens, full, 4, 0.8, True)
        s, _ = full_loss(params.view, params, tokens, short, 4, 0.8, True, widths=[1] * 5)
    torch.testing.assert_close(both * 8, f * 3 + s * 5, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc[1:], acc_f[1:])


def test_full_fine_tune_end_to_end(tmp_path):
    m = _load()
    before = [(mod.weight.clone(), mod.scales.clone()) for mod in _ternary_modules(m.decoder)]
    windows = periodic_windows()
    out = tmp_path / "tuned.gguf"
    cfg = TrainConfig(out=str(out), mode="full", block_size=4, max_steps=40, lr=1e-2, anchors=8, seed=3,
                      self_distill=False, save_dtype="float32", data_description="synthetic")
    res = train(m.decoder, windows, cfg, progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < 0.7 * first  # the joint loss falls
    assert res.path == out and out.is_file() and not (tmp_path / "tuned.gguf.ckpt").exists()
    after = list(_ternary_modules(m.decoder))
    assert any(not torch.equal(a.weight, w) for a, (w, _) in zip(after, before, strict=True))  # codes moved
    assert any(not torch.equal(a.scales, s) for a, (_, s) in zip(after, before, strict=True))  # scales too
    for mod in after:  # still ternary, packed
        assert set(mod.ternary_weight().unique().tolist()) <= {-1, 0, 1}
    loaded = bitmtp.load(out, capacity=256)
    assert loaded.adapter_config is not None and loaded.adapter_config.kind == "mask-block"
    assert loaded.adapter_config.targets == [] and loaded.adapter_config.training["mode"] == "full"
    prompt = windows[5][:10]
    ar_mem = bitmtp.generate(m, input_ids=prompt, max_new_tokens=24, policy="ar", eos_token_id=[]).token_ids
    ar_file = bitmtp.generate(loaded, input_ids=prompt, max_new_tokens=24, policy="ar", eos_token_id=[]).token_ids
    assert ar_mem == ar_file
    spec = bitmtp.generate(loaded, input_ids=prompt, max_new_tokens=24, policy="speculative", block_size=4,
                           eos_token_id=[])
    assert spec.token_ids == ar_file
    assert spec.stats.mean_committed > 1.0  # the tuned model drafts the periodic corpus


def test_bad_input(tmp_path):
    with pytest.raises(BitMTPError, match=r"\.gguf"):
        TrainConfig(out=str(tmp_path / "folder"), mode="full").validate()
    with pytest.raises(BitMTPError, match="init_from"):
        TrainConfig(out=str(tmp_path / "x.gguf"), mode="full", init_from=str(tmp_path)).validate()
    with pytest.raises(BitMTPError, match="mode"):
        TrainConfig(out=str(tmp_path / "x"), mode="everything").validate()

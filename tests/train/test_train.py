"""Training: packed layout vs brute force, the training forward vs the inference engine, the gate,
loss falls on a fixed seed, save → load → identical drafts, checkpoints and resume, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.formats.adapters import load_adapter
from bitmtp.model.decoder import StepInputs
from bitmtp.runtime import Engine, ReplayState
from bitmtp.train import TrainConfig, packed_layout, packed_layout_reference, token_windows, train
from bitmtp.train.forward import MaskBlockParams, TrainView
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import CharTokenizer
from tests.support.training import periodic_windows

pytest.importorskip("transformers")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_packed_mask_equals_brute_force(data):
    d = data.draw(st.integers(2, 8))
    t = data.draw(st.integers(d + 1, 30))
    anchors = sorted(data.draw(st.sets(st.integers(0, t - d - 1), max_size=5)))
    lay = packed_layout(t, anchors, d)
    assert torch.equal(lay.mask, packed_layout_reference(t, anchors, d))
    w = d - 1
    for a, anc in enumerate(anchors):
        rows = slice(t + a * w, t + (a + 1) * w)
        assert lay.positions[rows].tolist() == [anc + 1 + j for j in range(w)]
        assert lay.block_targets[a * w : (a + 1) * w].tolist() == [anc + 2 + j for j in range(w)]
        assert lay.block_k[a * w : (a + 1) * w].tolist() == list(range(1, d))


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary")


@pytest.mark.parametrize("family,quantize", [("llama", "ternary"), ("qwen3", None), ("bitnet", None)])
def test_training_forward_matches_the_engine(family, quantize):
    """Sequence rows: the training view's logits equal the engine's prefill logits (float32; ternary
    layers fake-quantize activations as the kernels do: rtol/atol 1e-3). Block rows: equal the
    mask-block drafter's logits for a block after the last token."""
    m = bitmtp.load(tiny_model(family, seed=5, initializer_range=INIT_RANGE), capacity=128, quantize=quantize)
    cfg, tensors = random_adapter(m.args, "mask-block", block_size=4)
    m.load_adapter((cfg, tensors))
    ids = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(1))
    view = TrainView(m.decoder)
    lay = packed_layout(20, [20 - 4 - 1], 4)
    params = MaskBlockParams(cfg, tensors)
    x = torch.cat([view.embed[ids][None], params.mask_embedding.expand(1, 3, -1)], 1)
    with torch.no_grad():
        logits = view.logits(view.hidden(x, lay.positions, lay.mask[None], lora=params, gate_from=20))[0]
    eng = Engine(m.decoder, capacity=128, m_max=31, keep_logits=True)
    r = eng._step("prefill", ids, 0)
    torch.testing.assert_close(logits[:20], r.logits, rtol=1e-3, atol=1e-3)
    # the same block at inference: pending rows = the sequence up to the anchor, then 3 mask rows
    anchor = lay.anchors[0]
    eng.reset()
    eng.prefill(ids[:anchor].tolist())
    eng.pool.set_drafter(m.drafter)
    dr = eng.pool.get(ReplayState(1 + 3, eng.kv.segment_for(anchor + 4), "draft", 4))
    dr.tokens[:1] = ids[anchor]
    torch.arange(anchor, anchor + 4, out=dr.positions)
    mask = dr.kv_index[None, :] <= torch.where(torch.arange(4) < 1, dr.positions, dr.positions[-1])[:, None]
    with torch.no_grad():
        ref = m.decoder(StepInputs(dr.tokens, dr.positions, mask, mask_rows=3, mask_block=m.drafter.block), eng.kv)
    torch.testing.assert_close(logits[20:], ref[1:], rtol=1e-3, atol=1e-3)


def test_gated_lora_leaves_sequence_rows_bit_identical(model):
    cfg, tensors = random_adapter(model.args, "mask-block", block_size=6)
    view = TrainView(model.decoder)
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(2))
    lay = packed_layout(30, [3, 11, 20], 6)
    params = MaskBlockParams(cfg, tensors)
    x = torch.cat([view.embed[ids], params.mask_embedding.expand(1, 15, -1)], 1)
    with torch.no_grad():
        with_lora = view.logits(view.hidden(x, lay.positions, lay.mask[None], lora=params, gate_from=30))
        without = view.logits(view.hidden(x, lay.positions, lay.mask[None]))
    assert torch.equal(with_lora[:, :30], without[:, :30])
    assert not torch.allclose(with_lora[:, 30:], without[:, 30:])


@pytest.mark.parametrize("mode", ["mask-block", "heads"])
def test_loss_falls_and_save_load_gives_identical_drafts(model, tmp_path, mode):
    windows = periodic_windows()  # a periodic corpus: the tokens 2..D ahead are learnable from the context
    cfg = TrainConfig(out=str(tmp_path / "ad"), mode=mode, block_size=4, rank=4, max_steps=60, lr=1e-2, anchors=8,
                      self_distill=False, seed=3, save_dtype="float32", data_description="synthetic")
    res = train(model.decoder, windows, cfg, progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < 0.7 * first
    config, tensors = load_adapter(res.path)
    assert config.training["steps"] == 60 and config.training["data"] == "synthetic" and config.fingerprint
    # the trained tensors drive the inference drafter: drafts equal those of the in-memory tensors
    prompt = windows[3][:12]
    outs = []
    for adapter in (res.path, (config, tensors)):
        model.load_adapter(adapter)
        outs.append(bitmtp.generate(model, input_ids=prompt, max_new_tokens=24, policy="confidence", tau=1e-9,
                                    eos_token_id=[]).token_ids)
    assert outs[0] == outs[1]
    # on its training data (teacher forcing) the drafter now predicts the block far better than chance
    assert min(res.accuracy) > 0.3


def test_checkpoint_and_resume_continue_the_same_run(model, tmp_path):
    w = periodic_windows()
    full = train(model.decoder, w, TrainConfig(out=str(tmp_path / "a"), max_steps=12, checkpoint_every=6, rank=2,
                                               block_size=3, anchors=4, seed=1, save_dtype="float32"),
                 progress=False)
    # an interrupted run: stop after 6 steps (time budget 0 after the checkpoint is simulated by max_steps)
    cfg = TrainConfig(out=str(tmp_path / "b"), max_steps=6, checkpoint_every=6, rank=2, block_size=3, anchors=4,
                      seed=1, save_dtype="float32")
    from bitmtp.train import trainer

    orig = trainer.save_adapter
    trainer.save_adapter = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())  # dies before the end
    try:
        with pytest.raises(KeyboardInterrupt):
            train(model.decoder, w, cfg, progress=False)
    finally:
        trainer.save_adapter = orig
    assert (tmp_path / "b.ckpt" / "state.pt").is_file() and not (tmp_path / "b").exists()
    cfg.max_steps, cfg.resume = 12, True
    resumed = train(model.decoder, w, cfg, progress=False)
    assert resumed.steps == 12 and not (tmp_path / "b.ckpt").exists()
    assert resumed.losses == pytest.approx(full.losses, rel=1e-4)
    ta, tb = load_adapter(full.path)[1], load_adapter(resumed.path)[1]
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-4, atol=1e-6)


def test_data_sources_and_bad_input(model, tmp_path):
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \xff")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hello world " * 10}) + "\n"
                                      + json.dumps({"messages": [{"role": "user", "content": "hi " * 20}]}) + "\n")
    w = token_windows([tmp_path], CharTokenizer(), 32, max_context=128, eos_token_id=2)
    assert w and all(len(x) == 32 for x in w)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BitMTPError, match="empty"):
        token_windows([tmp_path / "empty"], CharTokenizer(), 32, max_context=128)
    with pytest.raises(BitMTPError, match="context"):
        token_windows([tmp_path], CharTokenizer(), 4096, max_context=128)
    with pytest.raises(BitMTPError, match="does not exist"):
        token_windows([tmp_path / "nope"], CharTokenizer(), 32, max_context=128)
    (tmp_path / "out").mkdir()
    with pytest.raises(BitMTPError, match="exists"):
        train(model.decoder, periodic_windows(), TrainConfig(out=str(tmp_path / "out")), progress=False)
    with pytest.raises(BitMTPError, match="mode"):
        train(model.decoder, periodic_windows(), TrainConfig(out=str(tmp_path / "x"), mode="everything"),
              progress=False)


def test_non_utf8_files_are_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("some text " * 20)
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe bad \xff")
    with caplog.at_level("WARNING", logger="bitmtp.train"):
        token_windows([tmp_path], CharTokenizer(), 16, max_context=128)
    assert "b.txt" in caplog.text and "not UTF-8" in caplog.text


def test_shipped_adapter_attaches_only_to_its_base(tmp_path, monkeypatch):
    from bitmtp.formats.adapters import AdapterConfig, BaseShape, save_adapter
    from bitmtp.model.adapters import base_fingerprint, init_adapter_tensors

    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    base = bitmtp.load(hf, capacity=64, adapter=None)
    cfg = AdapterConfig("heads", 4, 4, BaseShape.of(base.args), fingerprint=base_fingerprint(base.decoder),
                        training={"preference": 1})
    save_adapter(tmp_path / "tiny-heads", cfg, init_adapter_tensors(cfg, seed=1))
    other = AdapterConfig("mask-block", 4, 4, BaseShape.of(base.args), fingerprint="0" * 16)
    save_adapter(tmp_path / "other", other, init_adapter_tensors(other, seed=1))
    monkeypatch.setenv("BITMTP_ADAPTERS", str(tmp_path))
    auto = bitmtp.load(hf, capacity=64)
    assert auto.adapter_config is not None and auto.adapter_config.kind == "heads"
    assert bitmtp.load(hf, capacity=64, adapter=None).drafter is None
    # same architecture, other weights: not attached
    assert bitmtp.load(tiny_model("llama", seed=4, initializer_range=INIT_RANGE), capacity=64).drafter is None
    # other weights through the same architecture's quantized load: fingerprint differs too
    assert bitmtp.load(hf, capacity=64, quantize="ternary").drafter is None


def test_init_from_continues_an_adapter(model, tmp_path):
    w = periodic_windows()
    first = train(model.decoder, w, TrainConfig(out=str(tmp_path / "a"), max_steps=30, rank=2, block_size=3, anchors=4,
                                                lr=1e-2, seed=1, save_dtype="float32", self_distill=False),
                  progress=False)
    more = train(model.decoder, w, TrainConfig(out=str(tmp_path / "b"), max_steps=5, rank=2, block_size=3, anchors=4,
                                               lr=1e-9, seed=1, save_dtype="float32", self_distill=False,
                                               init_from=str(first.path)), progress=False)
    # lr ~ 0: the continued run evaluates the first run's tensors, so its loss starts where that one ended
    assert more.losses[0] < 0.8 * first.losses[0]
    # a higher rank grows the adapter without changing its function: the same first loss
    grown = train(model.decoder, w, TrainConfig(out=str(tmp_path / "g"), max_steps=1, rank=5, block_size=3,
                                                anchors=4, lr=1e-9, seed=1, save_dtype="float32",
                                                self_distill=False, init_from=str(first.path)), progress=False)
    assert grown.losses[0] == pytest.approx(more.losses[0], rel=1e-5)
    assert load_adapter(grown.path)[0].rank == 5
    with pytest.raises(BitMTPError, match="rank=2, this run 1"):
        train(model.decoder, w, TrainConfig(out=str(tmp_path / "c"), max_steps=1, rank=1, block_size=3,
                                            init_from=str(first.path)), progress=False)
    with pytest.raises(BitMTPError, match="lora-alpha"):
        train(model.decoder, w, TrainConfig(out=str(tmp_path / "c"), max_steps=1, rank=4, block_size=3,
                                            lora_alpha=8.0, init_from=str(first.path)), progress=False)


def test_grow_lora_rank_keeps_every_delta(model):
    from bitmtp.train.trainer import grow_lora_rank

    cfg, tensors = random_adapter(model.args, "mask-block", block_size=4)
    big = dataclasses.replace(cfg, rank=cfg.rank + 3)
    grown = grow_lora_rank(tensors, big, seed=7)
    assert set(grown) == set(tensors) and set(grown) == set(big.expected_shapes())
    for name, shape in big.expected_shapes().items():
        assert tuple(grown[name].shape) == tuple(shape)
    for name in tensors:
        if name.endswith(".lora_A"):
            b = name[: -len("A")] + "B"
            torch.testing.assert_close(grown[b] @ grown[name], tensors[b] @ tensors[name], rtol=0, atol=0)
            assert grown[name][cfg.rank:].abs().sum() > 0  # new directions exist, their B starts at zero
    assert torch.equal(grown["mask_embedding"], tensors["mask_embedding"])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_packed_mask_with_short_blocks_equals_brute_force(data):
    d = data.draw(st.integers(2, 8))
    t = data.draw(st.integers(d + 1, 30))
    n = data.draw(st.integers(0, 6))
    widths = [data.draw(st.integers(1, d - 1)) for _ in range(n)]
    anchors = [data.draw(st.integers(0, t - w - 2)) for w in widths]  # repeats allowed: blocks are separate
    lay = packed_layout(t, anchors, d, widths=widths)
    assert torch.equal(lay.mask, packed_layout_reference(t, anchors, d, widths=widths))
    row = 0
    for anc, w in zip(anchors, widths, strict=True):
        rows = slice(t + row, t + row + w)
        assert lay.positions[rows].tolist() == [anc + 1 + j for j in range(w)]
        assert lay.block_targets[row : row + w].tolist() == [anc + 2 + j for j in range(w)]
        assert lay.block_k[row : row + w].tolist() == list(range(1, w + 1))
        row += w
    assert lay.length == t + sum(widths)


def test_short_block_is_a_d2_block():
    """A one-row block at D = 8 is exactly the block a D = 2 step drafts (same rows, positions, mask)."""
    short = packed_layout(24, [3, 9, 9], 8, widths=[1, 1, 7])
    assert torch.equal(short.mask[: 24 + 2, : 24 + 2], packed_layout(24, [3, 9], 2).mask)
    with pytest.raises(BitMTPError, match="widths"):
        packed_layout(24, [3], 4, widths=[4])
    with pytest.raises(BitMTPError, match="widths"):
        packed_layout(24, [3, 4], 4, widths=[1])
    with pytest.raises(BitMTPError, match="anchors"):
        packed_layout(24, [22], 4, widths=[1])  # its target x_24 does not exist


def test_block_loss_is_the_mean_over_blocks_of_any_width(model):
    """Blocks never see each other: the loss of full and short blocks packed together is the
    block-count-weighted mean of their losses apart (float32, rtol 1e-5)."""
    from bitmtp.train.trainer import mask_block_loss

    cfg, tensors = random_adapter(model.args, "mask-block", block_size=5)
    params = MaskBlockParams(cfg, tensors)
    view = TrainView(model.decoder)
    tokens = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(4))
    full, short = [2, 17, 30], [0, 5, 17, 21, 37]
    with torch.no_grad():
        both, acc = mask_block_loss(view, params, tokens, full + short, 5, 0.7, True, widths=[4] * 3 + [1] * 5)
        f, acc_f = mask_block_loss(view, params, tokens, full, 5, 0.7, True)
        sh, _ = mask_block_loss(view, params, tokens, short, 5, 0.7, True, widths=[1] * 5)
    torch.testing.assert_close(both * 8, f * 3 + sh * 5, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc[1:], acc_f[1:])  # positions 2..4: the full blocks only


def test_short_anchors_train_and_are_recorded(model, tmp_path):
    w = periodic_windows()
    res = train(model.decoder, w, TrainConfig(out=str(tmp_path / "s"), max_steps=40, rank=4, block_size=4, anchors=2,
                                              short_anchors=12, lr=1e-2, seed=3, save_dtype="float32",
                                              self_distill=False), progress=False)
    assert sum(res.losses[-5:]) < 0.7 * sum(res.losses[:5])
    assert load_adapter(res.path)[0].training["short_anchors"] == 12
    with pytest.raises(BitMTPError, match="heads"):
        train(model.decoder, w, TrainConfig(out=str(tmp_path / "h"), mode="heads", short_anchors=4), progress=False)
    with pytest.raises(BitMTPError, match="short_anchors"):
        train(model.decoder, w, TrainConfig(out=str(tmp_path / "n"), short_anchors=-1), progress=False)


def test_frozen_view_of_an_unfused_projection_runs_its_parts():
    """A projection the decoder could not fuse (ternary and dense parts) is viewed part by part:
    equal to the concatenated views of the parts (float32, exact: same ops per part)."""
    from bitmtp.model.fuse import fuse_rows
    from bitmtp.model.layers import DenseLinear
    from bitmtp.ops import TernaryLinear
    from bitmtp.train.forward import FrozenProjection

    g = torch.Generator().manual_seed(0)
    tern = TernaryLinear.from_float(torch.nn.Linear(40, 24))
    dense = DenseLinear(torch.randn(8, 40, generator=g))
    mixed = fuse_rows([tern, dense])
    view = FrozenProjection(mixed, torch.float32)
    x = torch.randn(3, 40, generator=g)
    ref = torch.cat([FrozenProjection(tern, torch.float32)(x), FrozenProjection(dense, torch.float32)(x)], -1)
    assert torch.equal(view(x), ref)
    torch.testing.assert_close(view(x)[:, 24:], x @ dense.weight.T)


def test_heads_base_state_cache(model):
    """The frozen base's hidden states are computed once per window: a second visit is a cache hit
    returning the same tensors; the heads loss on cached states equals the uncached loss up to the
    cache's float16 storage (rtol 1e-2); past max_bytes windows are computed but not kept."""
    from bitmtp.formats.adapters import AdapterConfig, BaseShape
    from bitmtp.model.adapters import init_adapter_tensors
    from bitmtp.train.forward import HeadsParams
    from bitmtp.train.trainer import BaseStateCache, heads_loss

    view = TrainView(model.decoder)
    tokens = torch.tensor(periodic_windows(n=3, length=40))
    cache = BaseStateCache(view)
    first = cache.get([0, 1, 2], tokens)
    again = cache.get([2, 0], tokens[[2, 0]])
    assert cache.hits == 2 and len(cache.store) == 3
    assert torch.equal(again[0], first[0][[2, 0]]) and torch.equal(again[1], first[1][[2, 0]])
    cfg = AdapterConfig(kind="heads", block_size=4, rank=4, base=BaseShape.of(model.args))
    params = HeadsParams(cfg, init_adapter_tensors(cfg, seed=0, zero_init_b=False), eps=model.args.rms_norm_eps)
    cached, _ = heads_loss(view, params, tokens, [3, 17, 30], 4, 0.8, True, states=first)
    plain, _ = heads_loss(view, params, tokens, [3, 17, 30], 4, 0.8, True)
    torch.testing.assert_close(cached, plain, rtol=1e-2, atol=1e-3)
    tiny = BaseStateCache(view, max_bytes=0)
    assert torch.equal(tiny.get([0], tokens[:1])[1], first[1][:1]) and not tiny.store


@pytest.mark.parametrize("family,quantize", [("llama", "ternary"), ("qwen3", None)])
def test_gated_two_stream_forward_equals_the_joint_pass(family, quantize):
    """TrainView.hidden_gated (sequence rows without autograd, block rows differentiated) == hidden over
    the packed rows: hidden states and the adapter's gradients (rtol/atol 1e-9). In float64: the two
    streams differ only in float summation order, and in float32 that order alone flips an int8 rounding
    of the ternary view's fake-quantized activations on some CPUs (one row off by a quantum: CI, session
    12); in float64 a flip needs a value within ~1e-16 of a rounding boundary."""
    m = bitmtp.load(tiny_model(family, seed=6, initializer_range=INIT_RANGE), capacity=128, quantize=quantize)
    cfg, tensors = random_adapter(m.args, "mask-block", block_size=4)
    view = TrainView(m.decoder, dtype=torch.float64)
    lay = packed_layout(26, [1, 9, 9, 20], 4, widths=[3, 3, 1, 2])
    ids = torch.randint(3, 90, (2, 26), generator=torch.Generator().manual_seed(8))
    grads, hiddens = [], []
    for gated in (False, True):
        params = MaskBlockParams(cfg, tensors).double()
        emb = view.embed[ids]
        rows = params.mask_embedding.expand(2, lay.block_k.numel(), -1)
        if gated:
            hs, hb = view.hidden_gated(emb, rows, lay.positions, lay.mask[None], lora=params)
        else:
            h = view.hidden(torch.cat([emb, rows], 1), lay.positions, lay.mask[None], lora=params, gate_from=26)
            hs, hb = h[:, :26], h[:, 26:]
        assert not hs.requires_grad or not gated
        (view.logits(hb).logsumexp(-1).sum() + hb.square().sum()).backward()
        hiddens.append((hs.detach(), hb.detach()))
        grads.append({k: p.grad.clone() for k, p in params.named_parameters()})
    for a, b in zip(hiddens[0], hiddens[1], strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        assert grads[0][k].abs().sum() > 0
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-9, atol=1e-9)

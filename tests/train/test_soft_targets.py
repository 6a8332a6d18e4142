"""Soft self-distillation targets (``train --soft-targets W``): the loss against the base's whole
next-token distribution, mixed with the argmax CE. Float losses are compared to a float64 reference
(rtol 1e-5); the training run must learn and record the setting; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.formats.adapters import load_adapter
from bitmtp.train import TrainConfig, train
from bitmtp.train.forward import MaskBlockParams, TrainView
from bitmtp.train.losses import weighted_block_ce
from bitmtp.train.masks import packed_layout
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import CharTokenizer
from tests.support.training import periodic_windows


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("transformers")
    return bitmtp.load(tiny_model("llama", seed=5, initializer_range=INIT_RANGE), capacity=256,
                       tokenizer=CharTokenizer(), adapter=None)


def _reference(logits, targets, block_k, gamma, n_blocks, soft, w):
    """Row by row in float64: ((1 − w) · −log q[target] + w · −Σ p log q) · γ^k, summed / (B · blocks)."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(logits.shape[0]):
        for r in range(logits.shape[1]):
            logq = torch.log_softmax(logits[b, r].double(), -1)
            hard = -logq[targets[b, r]]
            softce = -(soft[b, r].double().exp() * logq).sum() if soft is not None else 0.0
            total += ((1 - w) * hard + w * softce) * gamma ** int(block_k[r])
    return total / (logits.shape[0] * n_blocks)


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 50), (15, 97)])
@pytest.mark.parametrize("w", [0.0, 0.35, 1.0])
def test_weighted_block_ce_with_soft_targets_matches_float64(rows, vocab, w):
    g = torch.Generator().manual_seed(rows * 31 + vocab)
    logits = torch.randn(2, rows, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (2, rows), generator=g)
    block_k = torch.randint(1, 4, (rows,), generator=g)
    soft = torch.log_softmax(torch.randn(2, rows, vocab, generator=g) * 2, -1)
    loss, acc = weighted_block_ce(logits, targets, block_k, 4, 0.7, n_blocks=3, soft=soft, soft_weight=w)
    torch.testing.assert_close(loss.double(), _reference(logits, targets, block_k, 0.7, 3, soft, w),
                               rtol=1e-5, atol=1e-6)
    hard, acc_hard = weighted_block_ce(logits, targets, block_k, 4, 0.7, n_blocks=3)
    torch.testing.assert_close(acc, acc_hard, equal_nan=True)  # accuracy is the argmax's, soft or not
    # a one-hot teacher is the argmax target: any weight gives the hard loss
    one_hot = torch.full_like(soft, float("-inf")).scatter_(-1, targets[..., None], 0.0)
    same, _ = weighted_block_ce(logits, targets, block_k, 4, 0.7, n_blocks=3, soft=one_hot, soft_weight=w)
    torch.testing.assert_close(same, hard, rtol=1e-5, atol=1e-6)


def test_mask_block_loss_takes_the_base_distribution_at_each_target(model):
    """The soft target of a block row predicting position j is the base's softmax at sequence row j − 1
    (recomputed here with a plain causal pass, float64 loss)."""
    from bitmtp.train.trainer import mask_block_loss

    cfg, tensors = random_adapter(model.args, "mask-block", block_size=5)
    params = MaskBlockParams(cfg, tensors)
    view = TrainView(model.decoder)
    tokens = torch.randint(3, 90, (2, 37), generator=torch.Generator().manual_seed(8))
    anchors, widths = [1, 14, 29, 3, 20], [4, 4, 4, 1, 1]
    with torch.no_grad():
        loss, _ = mask_block_loss(view, params, tokens, anchors, 5, 0.6, True, widths=widths, soft_weight=0.4)
        lay = packed_layout(37, anchors, 5, widths=widths)
        emb = view.embed[tokens]
        mask_rows = params.mask_embedding.expand(2, lay.block_k.numel(), -1)
        _, block_hidden = view.hidden_gated(emb, mask_rows, lay.positions, lay.mask[None], lora=params)
        student = view.logits(block_hidden)
        causal = torch.ones(37, 37, dtype=torch.bool).tril()
        base = view.logits(view.hidden(emb, torch.arange(37), causal[None]))
        teacher = torch.log_softmax(base.double(), -1)[:, lay.block_targets - 1]
        targets = base.argmax(-1)[:, lay.block_targets - 1]
    ref = _reference(student, targets, lay.block_k, 0.6, len(anchors), teacher, 0.4)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-5)


def test_soft_targets_train_and_are_recorded(model, tmp_path):
    w = periodic_windows()
    res = train(model.decoder, w, TrainConfig(out=str(tmp_path / "s"), max_steps=40, rank=4, block_size=4, anchors=2,
                                              short_anchors=8, lr=1e-2, seed=3, save_dtype="float32",
                                              soft_targets=0.5), progress=False)
    assert sum(res.losses[-5:]) < 0.7 * sum(res.losses[:5])
    assert load_adapter(res.path)[0].training["soft_targets"] == 0.5


@pytest.mark.parametrize("settings,match", [
    ({"soft_targets": 1.5}, r"soft_targets: must be in \[0, 1\]"),
    ({"soft_targets": -0.1}, r"soft_targets: must be in \[0, 1\]"),
    ({"soft_targets": 0.5, "mode": "heads"}, "mode 'heads'"),
    ({"soft_targets": 0.5, "self_distill": False}, "--no-self-distill"),
])
def test_bad_soft_target_settings_are_refused(tmp_path, settings, match):
    with pytest.raises(BitMTPError, match=match):
        TrainConfig(out=str(tmp_path / "x"), **settings).validate()
    assert not (tmp_path / "x").exists()


def test_cli_soft_targets_range(capsys):
    from bitmtp import cli

    assert cli.main(["train", "--out", "ad", "--soft-targets", "2"]) == 2
    assert "--soft-targets" in capsys.readouterr().err

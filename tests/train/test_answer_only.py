"""Answer-only training (``train --answer-only``): windows of whole distill records, blocks anchored on
answer tokens only. Rules: every record appears whole, in order, with its answer tokens — and only
those — marked; a block of weight 0 changes neither the loss nor any gradient; a run records it; bad
input is a BitMTPError naming the fix."""

from __future__ import annotations

import json

import pytest
import torch

import bitmtp
from bitmtp import cli, cli_train
from bitmtp.errors import BitMTPError
from bitmtp.formats.adapters import load_adapter
from bitmtp.train import TrainConfig, answer_windows, train
from bitmtp.train.forward import MaskBlockParams, TrainView
from bitmtp.train.losses import weighted_block_ce
from bitmtp.train.trainer import anchor_weights, mask_block_loss
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import CharTokenizer

pytest.importorskip("transformers")

EOS = 2


def _records(seed: int, n: int, longest: int = 30) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, longest, (1,), generator=g))
        out.append({"tokens": torch.randint(3, 90, (length,), generator=g).tolist(),
                    "prompt_tokens": int(torch.randint(0, length, (1,), generator=g))})
    return out


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("seq_len,seed", [(16, 0), (23, 1), (64, 2)])
def test_windows_hold_whole_records_and_mark_their_answers(tmp_path, seq_len, seed):
    recs = _records(seed, 40)
    _write(tmp_path / "c.jsonl", recs)
    windows, masks = answer_windows([tmp_path / "c.jsonl"], seq_len, max_context=128, eos_token_id=EOS,
                                    vocab_size=100)
    assert len(windows) == len(masks) and all(len(w) == seq_len == len(m) for w, m in zip(windows, masks, strict=True))
    # walk the windows as a reader would: records in order, each whole (cut to seq_len when longer),
    # answers marked, then a tail of end tokens that anchors nowhere
    it = iter(recs)
    pending = next(it)
    for w, m in zip(windows, masks, strict=True):
        at = 0
        while pending is not None:
            if pending["prompt_tokens"] >= seq_len:  # no answer token fits a window: the record is left out
                pending = next(it, None)
                continue
            toks = (pending["tokens"] + [EOS])[:seq_len]
            pt = pending["prompt_tokens"]
            want = ([False] * pt + [True] * (len(pending["tokens"]) - pt) + [False])[:seq_len]
            if at + len(toks) > seq_len:
                break
            assert w[at : at + len(toks)] == toks and m[at : at + len(toks)] == want
            at += len(toks)
            pending = next(it, None)
        assert w[at:] == [EOS] * (seq_len - at) and not any(m[at:])
        assert any(m)
    assert pending is None  # every record was placed


def test_answer_windows_bad_input(tmp_path):
    (tmp_path / "t.txt").write_text("plain text\n")
    with pytest.raises(BitMTPError, match="distill"):
        answer_windows([tmp_path / "t.txt"], 16, max_context=128)
    _write(tmp_path / "np.jsonl", [{"tokens": [5, 6, 7]}])
    with pytest.raises(BitMTPError, match=r"np.jsonl:1 needs 'prompt_tokens'"):
        answer_windows([tmp_path / "np.jsonl"], 16, max_context=128)
    _write(tmp_path / "big.jsonl", [{"tokens": [5, 6, 7], "prompt_tokens": 3}])
    with pytest.raises(BitMTPError, match=r"in \[0, 3\)"):
        answer_windows([tmp_path / "big.jsonl"], 16, max_context=128)
    _write(tmp_path / "v.jsonl", [{"tokens": [5, 600], "prompt_tokens": 1}])
    with pytest.raises(BitMTPError, match="vocabulary"):
        answer_windows([tmp_path / "v.jsonl"], 16, max_context=128, vocab_size=100)
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    with pytest.raises(BitMTPError, match="bad.jsonl:1 is not valid JSON"):
        answer_windows([tmp_path / "bad.jsonl"], 16, max_context=128)
    with pytest.raises(BitMTPError, match="longer than the model's context"):
        answer_windows([tmp_path / "v.jsonl"], 256, max_context=128)


@pytest.mark.parametrize("widths", [[3, 3, 3, 3], [3, 1, 1, 3, 1]])
def test_weight_zero_blocks_change_neither_loss_nor_gradient(widths):
    g = torch.Generator().manual_seed(7)
    bsz, d, vocab, gamma = 3, 4, 37, 0.7
    n = len(widths)
    block_k = torch.cat([torch.arange(1, w + 1) for w in widths])
    block_of_row = torch.arange(n).repeat_interleave(torch.tensor(widths))
    logits = torch.randn(bsz, block_k.numel(), vocab, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (bsz, block_k.numel()), generator=g)
    keep = torch.rand(bsz, n, generator=g) < 0.5
    keep[0, 0] = True
    loss, acc = weighted_block_ce(logits, targets, block_k, d, gamma, n_blocks=n, block_weight=keep.double(),
                                  block_of_row=block_of_row)
    loss.backward()
    # float64 reference: the mean over kept blocks of their rows' gamma^k-weighted cross-entropy
    ce = -torch.log_softmax(logits.detach(), -1).gather(-1, targets[..., None])[..., 0]
    rows_kept = keep[:, block_of_row]
    ref = (ce * gamma ** block_k.double() * rows_kept).sum() / keep.sum()
    torch.testing.assert_close(loss.detach().double(), ref, rtol=1e-6, atol=1e-6)  # the loss runs in float32
    assert torch.all(logits.grad[~rows_kept] == 0) and torch.all(logits.grad[rows_kept].abs().sum(-1) > 0)
    hit = logits.detach().argmax(-1) == targets
    for k in range(1, d):
        sel = rows_kept & (block_k == k)[None]
        want = hit[sel].double().mean() if sel.any() else torch.tensor(float("nan"), dtype=torch.float64)
        torch.testing.assert_close(acc[k - 1].double(), want, equal_nan=True)


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary")


def test_mask_block_loss_of_one_kept_block_is_that_block_alone(model):
    """Blocks never see each other, so keeping one block (weight 1, the rest 0) gives the loss of a batch
    that holds that block only (float32 summation order: rtol 1e-5)."""
    cfg, tensors = random_adapter(model.args, "mask-block", block_size=4)
    params = MaskBlockParams(cfg, {k: v.float() for k, v in tensors.items()})
    view = TrainView(model.decoder)
    tokens = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(2))
    anchors, widths = [2, 9, 15, 4, 11], [3, 3, 3, 1, 1]
    for j in range(len(anchors)):
        w = torch.zeros(1, len(anchors))
        w[0, j] = 1
        kept, _ = mask_block_loss(view, params, tokens, anchors, 4, 0.8, True, widths=widths, block_weight=w)
        alone, _ = mask_block_loss(view, params, tokens, [anchors[j]], 4, 0.8, True, widths=[widths[j]])
        torch.testing.assert_close(kept, alone, rtol=1e-5, atol=1e-6)
    every, _ = mask_block_loss(view, params, tokens, anchors, 4, 0.8, True, widths=widths,
                               block_weight=torch.ones(1, len(anchors)))
    none, _ = mask_block_loss(view, params, tokens, anchors, 4, 0.8, True, widths=widths)
    torch.testing.assert_close(every, none, rtol=1e-6, atol=1e-7)


def test_anchor_weights_read_each_windows_mask():
    masks = [[False, True, True, False], [True, False, True, True]]
    got = anchor_weights(masks, [1, 0, 1], [0, 2, 3])
    assert got.tolist() == [[1, 1, 1], [0, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("mode", ["mask-block", "heads"])
def test_answer_only_run_trains_and_is_recorded(model, tmp_path, mode):
    _write(tmp_path / "c.jsonl", _records(3, 60))
    windows, masks = answer_windows([tmp_path / "c.jsonl"], 32, max_context=128, eos_token_id=EOS, vocab_size=100)
    cfg = TrainConfig(out=str(tmp_path / mode), mode=mode, block_size=4, rank=2, max_steps=3, anchors=6,
                      short_anchors=4 if mode == "mask-block" else 0, seed=1, answer_only=True,
                      checkpoint_every=0)
    res = train(model.decoder, windows, cfg, progress=False, anchor_masks=masks)
    assert res.steps == 3 and all(torch.isfinite(torch.tensor(res.losses)))
    assert load_adapter(res.path)[0].training["answer_only"] is True
    # the masks reach the loss: with no block kept anywhere, every step's loss is exactly 0
    cfg.out = str(tmp_path / f"{mode}-none")
    res = train(model.decoder, windows, cfg, progress=False, anchor_masks=[[False] * len(w) for w in windows])
    assert res.losses == [0.0] * 3


def test_answer_only_bad_input(model, tmp_path):
    _write(tmp_path / "c.jsonl", _records(4, 20))
    windows, masks = answer_windows([tmp_path / "c.jsonl"], 32, max_context=128, eos_token_id=EOS)
    base = dict(block_size=4, rank=2, max_steps=1, anchors=4)
    with pytest.raises(BitMTPError, match="answer_windows"):
        train(model.decoder, windows, TrainConfig(out=str(tmp_path / "a"), answer_only=True, **base), progress=False)
    with pytest.raises(BitMTPError, match="answer_windows"):
        train(model.decoder, windows, TrainConfig(out=str(tmp_path / "b"), **base), progress=False,
              anchor_masks=masks)
    with pytest.raises(BitMTPError, match="one mask per window"):
        train(model.decoder, windows, TrainConfig(out=str(tmp_path / "c"), answer_only=True, **base),
              progress=False, anchor_masks=masks[:-1])
    with pytest.raises(BitMTPError, match="full fine-tune"):
        train(model.decoder, windows, TrainConfig(out=str(tmp_path / "d"), mode="full", answer_only=True, **base),
              progress=False, anchor_masks=masks)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_cli_answer_only(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli_train, "_load", lambda args: bitmtp.load(
        tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, tokenizer=CharTokenizer()))
    _write(tmp_path / "c.jsonl", _records(5, 50))
    out = tmp_path / "ad"
    argv = ["train", "--answer-only", "--data", str(tmp_path / "c.jsonl"), "--out", str(out), "--max-steps", "2",
            "--seq-len", "32", "--block-size", "4", "--rank", "2", "--anchors", "4", "--no-progress"]
    assert cli.main(argv) == 0
    training = load_adapter(out)[0].training
    assert training["answer_only"] is True and "answer tokens only" in training["data"]
    (tmp_path / "t.txt").write_text("just text\n" * 50)
    capsys.readouterr()
    assert cli.main(["train", "--answer-only", "--data", str(tmp_path / "t.txt"), "--out", str(tmp_path / "x"),
                     "--no-progress"]) == 2
    assert "bitmtp distill" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

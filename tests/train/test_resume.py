"""``train --resume``: a checkpoint is read with ``torch.load(weights_only=True)``, so a crafted file runs
nothing; every bad checkpoint (crafted, truncated, empty, missing, from another run) is a BitMTPError naming
``--resume``, the file and the fix; a real checkpoint holds only plain values and still resumes."""

from __future__ import annotations

import pickle

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.train import TrainConfig, train
from bitmtp.train import trainer as trainer_mod
from tests.support.adapters import INIT_RANGE
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=64)


def _windows(n: int = 8, length: int = 16, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n, length), generator=g).tolist()


def _cfg(out, **kw) -> TrainConfig:
    base = dict(out=str(out), max_steps=2, checkpoint_every=2, rank=2, block_size=3, anchors=2, seed=1,
                seq_len=16, save_dtype="float32")
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def real_state(model, tmp_path_factory) -> bytes:
    """The bytes of a real checkpoint: a run interrupted (at its final save) after its 2-step checkpoint."""
    out = tmp_path_factory.mktemp("ckpt") / "ad"
    orig = trainer_mod.save_adapter

    def die(*a, **k):
        raise KeyboardInterrupt

    trainer_mod.save_adapter = die
    try:
        with pytest.raises(KeyboardInterrupt):
            train(model.decoder, _windows(), _cfg(out), progress=False)
    finally:
        trainer_mod.save_adapter = orig
    return (out.parent / "ad.ckpt" / "state.pt").read_bytes()


def _place(tmp_path, data: bytes | None):
    """Put ``data`` where a run writing ``tmp_path/ad`` keeps its checkpoint; returns (out, state.pt)."""
    ckpt = tmp_path / "ad.ckpt"
    ckpt.mkdir()
    state = ckpt / "state.pt"
    if data is not None:
        state.write_bytes(data)
    return tmp_path / "ad", state


def _resume_error(model, out, windows=None, **kw) -> str:
    with pytest.raises(BitMTPError) as err:
        train(model.decoder, windows or _windows(), _cfg(out, resume=True, max_steps=4, **kw), progress=False)
    msg = str(err.value)
    assert "--resume" in msg
    return msg


def test_real_checkpoint_is_plain_and_resumes(model, real_state, tmp_path):
    out, state = _place(tmp_path, real_state)
    loaded = torch.load(state, weights_only=True)  # nothing but tensors and plain values
    assert loaded["step"] == 2 and len(loaded["losses"]) == 2 and sorted(loaded["order"]) == list(range(8))
    assert loaded["base"]["hidden_size"] == model.args.hidden_size and isinstance(loaded["fingerprint"], str)
    # the resumed run equals an uninterrupted one (same losses, same tensors)
    resumed = train(model.decoder, _windows(), _cfg(out, resume=True, max_steps=4), progress=False)
    whole = train(model.decoder, _windows(), _cfg(tmp_path / "whole", max_steps=4), progress=False)
    assert resumed.steps == 4 and resumed.losses == whole.losses
    a, b = bitmtp.formats.adapters.load_adapter(resumed.path)[1], bitmtp.formats.adapters.load_adapter(whole.path)[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "ad.ckpt").exists()


class _Plant:
    """Unpickling this calls ``func(*args)``: here, creating a marker file."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _crafted(kind: str, marker) -> bytes:
    import io

    payload = {"params": {}, "opt": {}, "step": 1, "evil": None}
    if kind == "torch-zip-open":
        payload["evil"] = _Plant(open, (str(marker), "w"))
        buf = io.BytesIO()
        torch.save(payload, buf)
        return buf.getvalue()
    payload["evil"] = _Plant(exec, (f"open({str(marker)!r}, 'w').close()",))
    return pickle.dumps(payload, protocol=2)  # torch.load's legacy (non-zip) format


@pytest.mark.parametrize("kind", ["torch-zip-open", "legacy-pickle-exec"])
def test_crafted_checkpoint_runs_nothing(model, tmp_path, kind):
    # the payload is live: an unrestricted load does create its marker (so the absence below means something)
    probe = tmp_path / "probe"
    (tmp_path / "probe.pt").write_bytes(_crafted(kind, probe))
    try:
        torch.load(tmp_path / "probe.pt", weights_only=False)
    except RuntimeError:  # the legacy format: the payload runs, then its "magic number" is wrong
        pass
    assert probe.exists()
    marker = tmp_path / "marker"
    out, state = _place(tmp_path, _crafted(kind, marker))
    msg = _resume_error(model, out)
    assert str(state) in msg and "not a plain tensor checkpoint" in msg and "delete" in msg
    assert not marker.exists()


@pytest.mark.parametrize("frac", [0.0, 0.03, 0.5, 0.97])
def test_truncated_or_empty_checkpoint(model, real_state, tmp_path, frac):
    out, state = _place(tmp_path, real_state[: int(len(real_state) * frac)])
    msg = _resume_error(model, out)
    assert str(state) in msg and ("empty" if frac == 0 else "damaged") in msg
    assert "run without --resume to start over" in msg


def test_missing_checkpoint_and_folder_without_state(model, tmp_path):
    msg = _resume_error(model, tmp_path / "ad")  # nothing to resume: refused, not a silent fresh start
    assert "no checkpoint" in msg and str(tmp_path / "ad.ckpt" / "state.pt") in msg
    out, state = _place(tmp_path, None)
    (state.parent / "state.pt.tmp").write_bytes(b"\x00" * 10)  # killed while writing its first checkpoint
    msg = _resume_error(model, out)
    assert f"{state.parent} has no state.pt" in msg and "delete" in msg
    state.mkdir()  # state.pt that is a folder
    assert "has no state.pt" in _resume_error(model, out)


def test_finished_run_is_not_retrained_by_resume(model, real_state, tmp_path):
    (tmp_path / "ad").mkdir()  # the adapter a finished run wrote; its checkpoint is gone
    msg = _resume_error(model, tmp_path / "ad")
    assert "that run finished" in msg


@pytest.mark.parametrize("change", ["rank", "block_size", "mode", "windows", "model", "no-base-record"])
def test_checkpoint_of_another_run(model, real_state, tmp_path, change):
    out, state = _place(tmp_path, real_state)
    run_model, windows, kw = model, None, {}
    if change == "rank":
        kw = {"rank": 4}
    elif change == "block_size":
        kw = {"block_size": 4}
    elif change == "mode":
        kw = {"mode": "heads"}
    elif change == "windows":
        windows = _windows(n=5)
    else:  # another base model: a wider tiny llama
        run_model = bitmtp.load(tiny_model("llama", seed=4, hidden_size=48), capacity=64)
        if change == "no-base-record":  # a checkpoint without the base record: the tensor shapes catch it
            st = torch.load(state, weights_only=True)
            del st["base"], st["fingerprint"]
            torch.save(st, state)
    msg = _resume_error(run_model, out, windows, **kw)
    assert str(state) in msg and "resume with the --model, --data and settings of the interrupted run" in msg
    expect = {"rank": "rank=2", "block_size": "block_size=3", "mode": "mode='mask-block'",
              "windows": "8 training windows, this run has 5", "model": "another model (hidden_size",
              "no-base-record": "does not fit this run's tensors"}[change]
    assert expect in msg


def test_checkpoint_of_same_shape_other_weights(real_state, tmp_path):
    other = bitmtp.load(tiny_model("llama", seed=11, initializer_range=INIT_RANGE), capacity=64)
    out, _ = _place(tmp_path, real_state)
    assert "same shape, other weights" in _resume_error(other, out)


@pytest.mark.parametrize("bad", ["tensor", "list", "no-opt", "step-str", "step-bool", "gen-list"])
def test_plain_file_that_is_not_a_checkpoint(model, real_state, tmp_path, bad):
    out, state = _place(tmp_path, real_state)
    st = torch.load(state, weights_only=True)
    value = {"tensor": torch.randn(3), "list": [1, 2], "no-opt": {k: v for k, v in st.items() if k != "opt"},
             "step-str": {**st, "step": "2"}, "step-bool": {**st, "step": True},
             "gen-list": {**st, "gen": st["gen"].tolist()}}[bad]
    torch.save(value, state)
    msg = _resume_error(model, out)
    assert str(state) in msg and "not a bitmtp training checkpoint" in msg


# --- distill --resume: OUT.partial of a killed run ---------------------------------------------------------


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in (4, 6, 5)]


def test_distill_resume_cuts_a_torn_last_record(model, tmp_path):
    import json

    from bitmtp.train.distill import distill_corpus

    prompts = _prompts(7)
    out, partial = tmp_path / "d.jsonl", tmp_path / "d.jsonl.partial"
    first = {"tokens": prompts[0] + [11, 12], "prompt_tokens": len(prompts[0])}
    torn = json.dumps({"tokens": prompts[1] + [13, 14, 15], "prompt_tokens": len(prompts[1])})[:-9]
    partial.write_text(json.dumps(first) + "\n" + torn)  # killed while writing record 2
    st = distill_corpus(model, prompts, out, max_new_tokens=4, resume=True, progress=False)
    recs = [json.loads(line) for line in out.read_text().splitlines()]  # every line is a whole record
    assert st.records == 3 and recs[0] == first
    for ids, rec in zip(prompts[1:], recs[1:], strict=True):  # the torn prompt ran again
        ar = bitmtp.generate(model, input_ids=ids, max_new_tokens=4, policy="ar")
        assert rec == {"tokens": ids + ar.token_ids, "prompt_tokens": len(ids)}


@pytest.mark.parametrize("bad", [b"not json", b'{"tokens": [1, "a"], "prompt_tokens": 1}', b"[1, 2]",
                                 b'{"tokens": [1, 2], "prompt_tokens": 5}', b'{"tokens": [1, 2]}', b"\xff\xfe{}"])
def test_distill_resume_refuses_a_foreign_partial(model, tmp_path, bad):
    import json

    from bitmtp.train.distill import distill_corpus

    prompts = _prompts(8)
    out, partial = tmp_path / "d.jsonl", tmp_path / "d.jsonl.partial"
    partial.write_bytes(json.dumps({"tokens": prompts[0] + [9], "prompt_tokens": 4}).encode() + b"\n" + bad + b"\n")
    with pytest.raises(BitMTPError) as err:
        distill_corpus(model, prompts, out, max_new_tokens=2, resume=True, progress=False)
    msg = str(err.value)
    assert "--resume" in msg and str(partial) in msg and "delete it" in msg
    assert ("line 2" in msg) or b"\xff" in bad
    assert not out.exists()

"""The host-glue harness (bench/glue.py): it times every call into the extension while active, restores the module
after (an exception too), and splits a step into native time and glue on a tiny model's solo and batched steps."""

from __future__ import annotations

import importlib

import pytest

from bench.glue import NATIVE_CALLS, batch_glue, native_time, solo_ar_glue

ext = pytest.importorskip("bitmtp._cpu_w2a8", reason="the native CPU extension is not built")


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("transformers")
    import bitmtp
    from tests.support.hf_models import tiny_model

    return bitmtp.load(tiny_model("llama", seed=1), capacity=200, quantize="ternary", adapter=None)


def test_native_time_wraps_and_restores_the_extension():
    real = {n: getattr(ext, n) for n in NATIVE_CALLS if hasattr(ext, n)}
    assert "fused_layers" in real and "argmax_prob" in real
    with pytest.raises(RuntimeError, match="inside"):
        with native_time() as nat:
            mod = importlib.import_module("bitmtp._cpu_w2a8")
            assert mod.fused_layers is not real["fused_layers"]  # every caller looks it up at call time
            raise RuntimeError("inside")
    assert nat.calls == 0 and all(getattr(ext, n) is f for n, f in real.items())


def test_a_step_splits_into_native_time_and_glue(model):
    solo = solo_ar_glue(model, steps=6)
    assert solo.steps == 6 and 0 < solo.native_ms < solo.step_ms and solo.glue_ms == solo.step_ms - solo.native_ms
    b = batch_glue(model, 3, steps=4, max_batch=4)
    assert b.steps == 4 and 0 < b.native_ms < b.step_ms
    assert model.batcher(4).rows_in_use == 0  # its sequences closed: their rows back

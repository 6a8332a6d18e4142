"""float16 KV store (``bitmtp.load(kv_type="f16")``, ``--kv-type f16``; issue 24 item 3).

Rules: a float16 store holds half the bytes of a float32 one; every verifying policy commits exactly AR's
tokens over the same float16 store (each row's arithmetic depends on its own inputs only, whatever the
step's width), through the fused native layers (asserted: the steps really ran them); the tokens stay
close to float32's (float16 K/V differ by a rounding); bad values get a BitMTPError naming ``kv_type``.
"""

from __future__ import annotations

import json

import pytest
import torch

import bitmtp
from bitmtp import cli
from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import FUSED
from bitmtp.ops.registry import availability
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

NEW = 48


@pytest.fixture(scope="module")
def hf():
    return tiny_model("llama", seed=3, initializer_range=INIT_RANGE)


@pytest.fixture(scope="module")
def model16(hf):
    return bitmtp.load(hf, capacity=512, quantize="ternary", kv_type="f16", adapter=None)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, 95, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(6)]


def test_store_is_half_the_bytes(hf, model16):
    model32 = bitmtp.load(hf, capacity=512, quantize="ternary", adapter=None)
    assert all(t.dtype == torch.float16 for t in model16.engine.kv.k + model16.engine.kv.v)
    assert model16.engine.kv.nbytes * 2 == model32.engine.kv.nbytes


@pytest.mark.parametrize("kind", ["mask-block", "heads"])
@pytest.mark.parametrize("config", [dict(policy="speculative", block_size=4),
                                    dict(policy="speculative", block_size=8, schedule="one-pass"),
                                    dict(policy="auto")], ids=["two-pass-4", "one-pass-8", "auto"])
def test_every_verifying_policy_equals_ar_over_float16_kv(model16, prompts, kind, config):
    model16.load_adapter(random_adapter(model16.args, kind))
    try:
        for p in prompts:
            ref = bitmtp.generate(model16, input_ids=p, max_new_tokens=NEW, policy="ar", eos_token_id=[])
            out = bitmtp.generate(model16, input_ids=p, max_new_tokens=NEW, eos_token_id=[], **config)
            assert out.token_ids == ref.token_ids, (kind, config, p)
    finally:
        model16.load_adapter(None)


@pytest.mark.skipif(not availability("cpu", "cpu")[0], reason="native CPU extension not built")
def test_float16_kv_runs_the_fused_layers(model16):
    bitmtp.generate(model16, input_ids=[5, 6, 7], max_new_tokens=3, policy="ar", eos_token_id=[])
    assert model16.decoder.last_path == FUSED, model16.decoder.fused_reason


def test_sampling_over_float16_kv_equals_ar_sampling(model16, prompts):
    model16.load_adapter(random_adapter(model16.args, "mask-block"))
    try:
        for seed, p in enumerate(prompts[:3]):
            kw = dict(input_ids=p, max_new_tokens=NEW, eos_token_id=[], temperature=0.8, top_p=0.9, seed=seed)
            ref = bitmtp.generate(model16, policy="ar", **kw)
            assert bitmtp.generate(model16, policy="auto", **kw).token_ids == ref.token_ids
    finally:
        model16.load_adapter(None)


@pytest.mark.parametrize("bad", ["int8", "q8_0", "", 16, torch.float16])
def test_bad_kv_type_names_the_argument(hf, bad):
    with pytest.raises(BitMTPError, match="kv_type"):
        bitmtp.load(hf, capacity=64, kv_type=bad)


def test_kv_type_is_case_insensitive(hf):
    assert bitmtp.load(hf, capacity=64, kv_type="F16", adapter=None).engine.kv.k[0].dtype == torch.float16


def test_vulkan_refuses_float16_kv_before_opening_a_device(hf):
    with pytest.raises(BitMTPError, match="kv_type.*vulkan"):
        bitmtp.load(hf, capacity=64, kv_type="f16", runtime="vulkan")


def test_cli_kv_type(tmp_path, capsys):
    model_dir = tmp_path / "m"
    tiny_model("llama", seed=3, initializer_range=0.3).save_pretrained(model_dir)
    argv = ["generate", "--model", str(model_dir), "--input-ids", "5,6,7,8", "--max-new-tokens", "12", "--json"]
    assert cli.main([*argv, "--kv-type", "f16", "--policy", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--kv-type", "f16", "--policy", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ar["token_ids"]
    assert cli.main([*argv, "--kv-type", "q4"]) == 2
    assert "--kv-type" in capsys.readouterr().err

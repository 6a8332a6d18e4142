"""Decoding options validated once into a frozen ``DecodingConfig`` shared by generate, the CLI, serve and the HF
patch (issue 45, item 1): what it holds, that a config decodes exactly as the options it was built from, and what
bad input gets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import bitmtp
from bitmtp.decoding.config import DecodingConfig
from bitmtp.errors import BitMTPError
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

VOCAB = 97  # tiny_model's


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=5, initializer_range=INIT_RANGE), capacity=96, adapter=None)


@pytest.fixture
def prompt(rng):
    return torch.randint(3, VOCAB, (int(torch.randint(4, 20, (1,), generator=rng)),), generator=rng).tolist()


def test_a_config_holds_the_resolved_options(model):
    cfg = bitmtp.decoding_config(model, max_new_tokens=7, policy="ar", eos_token_id=[5, 9], temperature=0.5,
                                 seed=3, logprobs=True)
    assert isinstance(cfg, bitmtp.DecodingConfig) and cfg is not None
    assert (cfg.policy.name, cfg.block_size, cfg.drafter, cfg.max_new_tokens, cfg.eos, cfg.logprobs) == (
        "ar", 8, None, 7, (5, 9), True)
    assert (cfg.sampling.temperature, cfg.sampling.seed) == (0.5, 3)
    assert cfg.batchable and cfg.mask_block is None
    assert cfg.solo_kwargs()["policy"] is cfg.policy and cfg.batch_kwargs()["draft"] is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_new_tokens = 9  # type: ignore[misc]
    auto = model.decoding_config()  # the default: auto, drafting by prompt lookup without an adapter
    assert auto.policy.name == "auto" and auto.drafter.kind == "lookup" and auto.batch_kwargs()["draft"] is True
    assert "lookup only" in auto.notes[0]


@pytest.mark.parametrize("options", [
    dict(policy="ar"),
    dict(policy="auto", temperature=0.8, top_k=20, seed=11),
    dict(policy="speculative", drafter="lookup", block_size=5),
    dict(policy="ar", logprobs=True, repetition_penalty=1.3),
])
def test_a_config_decodes_as_its_options(model, prompt, options):
    """generate(config=decoding_config(**options)) gives exactly generate(**options)'s tokens (and logprobs)."""
    options = dict(max_new_tokens=14, eos_token_id=[], **options)
    direct = bitmtp.generate(model, input_ids=prompt, **options)
    cfg = bitmtp.decoding_config(model, **options)
    via = bitmtp.generate(model, input_ids=prompt, config=cfg)
    again = bitmtp.generate(model, input_ids=prompt, config=cfg)  # one config, reused
    assert via.token_ids == direct.token_ids == again.token_ids
    assert via.logprobs == direct.logprobs
    batched = bitmtp.generate(model, prompts=[prompt, prompt[:3]], config=cfg)
    assert batched[0].token_ids == direct.token_ids


def test_a_config_for_a_mask_block_adapter_drafts_with_its_mask_rows_in_a_batch(rng):
    hf = tiny_model("llama", seed=7, initializer_range=INIT_RANGE)
    m = bitmtp.load(hf, capacity=96, adapter=None)
    m.load_adapter(random_adapter(m.args, "mask-block", block_size=4))
    cfg = m.decoding_config(policy="auto", block_size=4)
    assert cfg.drafter.kind == "lookup+adapter" and cfg.mask_block is m.drafter.block
    assert cfg.batch_kwargs()["masks"] is m.drafter.block


@pytest.mark.parametrize(("options", "named"), [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(block_size=1, policy="speculative", drafter="lookup"), "block_size"),
    (dict(temperature=-1.0), "temperature"),
    (dict(policy="beam"), "policy"),
    (dict(policy="speculative"), "policy"),  # drafts, and no adapter is attached
    (dict(drafter=3), "drafter"),
    (dict(stop=[""]), "stop"),
    (dict(logprobs="yes"), "logprobs"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_options_name_themselves(model, options, named):
    with pytest.raises(BitMTPError, match=rf"^{named}\b"):
        bitmtp.decoding_config(model, **options)


def test_a_config_beside_its_options_or_of_another_kind_is_refused(model, prompt):
    cfg = model.decoding_config(policy="ar", max_new_tokens=4)
    with pytest.raises(BitMTPError, match=r"config: .*also given: temperature, seed"):
        bitmtp.generate(model, input_ids=prompt, config=cfg, temperature=0.7, seed=1)
    with pytest.raises(BitMTPError, match=r"config: expected a DecodingConfig"):
        bitmtp.generate(model, input_ids=prompt, config={"policy": "ar"})
    with pytest.raises(BitMTPError, match=r"^model: "):
        bitmtp.decoding_config("not a model")
    # the defaults themselves beside a config are no conflict
    out = bitmtp.generate(model, input_ids=prompt, config=cfg, policy="auto", max_new_tokens=128)
    assert len(out.token_ids) <= 4


def test_serve_requests_and_the_patch_decode_with_a_config(model):
    """serve checks a request's options into the config it decodes with (a 400 naming the field for a bad one); the
    HF patch keeps one config for its policy and sets each call's limits on a copy."""
    from bitmtp.serve.errors import APIError
    from bitmtp.serve.params import parse_request

    req = parse_request({"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0.3, "seed": 2}, chat=False,
                        model=model, model_name="m")
    assert isinstance(req.config, DecodingConfig)
    assert (req.config.max_new_tokens, req.config.sampling.temperature, req.config.policy.name) == (5, 0.3, "auto")
    with pytest.raises(APIError) as err:
        parse_request({"prompt": [5, 6], "stop": [""]}, chat=False, model=model, model_name="m")
    assert err.value.status == 400 and "stop" in str(err.value)

    from bitmtp.hf import patch_state

    hf = tiny_model("llama", seed=5, initializer_range=INIT_RANGE)
    bitmtp.patch(hf, adapter=None, policy="ar")
    try:
        state = patch_state(hf)
        assert isinstance(state.config, DecodingConfig) and state.config.policy.name == "ar"
        out = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)
        assert state.calls["bitmtp"] == 1 and out.shape[1] <= 9
    finally:
        bitmtp.unpatch(hf)

"""The wgpu backend end to end (``bitmtp.load(..., backend="wgpu")``): whole layers on a Vulkan device.

Rules: greedy output equals the torch backend's token for token, for tiny ternary models of the three
families, with ar / speculative / hybrid, with no layers offloaded and with half of them on the CPU; a
decode iteration reads back once (counted on the device runner); bad input raises BitMTPError showing the
plan. Runs on Mesa lavapipe in CI (BITMTP_REQUIRE_WGPU=1 turns a missing adapter into a failure).
"""

from __future__ import annotations

import pytest

import bitmtp
from bitmtp.errors import BackendUnavailableError, BitMTPError
from bitmtp.formats.adapters import AdapterConfig, BaseShape
from bitmtp.model.adapters import init_adapter_tensors
from tests.hf_models import FAMILIES, tiny_model
from tests.wgpu_device import device_runner_or_skip

pytestmark = pytest.mark.wgpu
PROMPT = [1, 5, 7, 9, 11, 3, 4, 60]
DRAFTER = {"llama": "mask-block", "qwen3": "heads", "bitnet": "mask-block"}
#: per family, two tiny models (the second with a wider MLP) whose greedy continuations of PROMPT are
#: long and varied: the default init of a tied qwen3 model copies the last prompt token forever, and
#: some bitnet seeds stop at EOS after a few tokens; equal outputs of such models would prove little
VARIED = {"llama": (dict(seed=3), dict(seed=8, intermediate_size=160)),
          "qwen3": (dict(seed=5, initializer_range=0.2), dict(seed=2, initializer_range=0.2, intermediate_size=160)),
          "bitnet": (dict(seed=6, initializer_range=0.2), dict(seed=4, initializer_range=0.2, intermediate_size=160))}


@pytest.fixture(scope="module")
def device_runner():
    return device_runner_or_skip()


def _adapter(model, kind):
    cfg = AdapterConfig(kind=kind, block_size=4, rank=4, base=BaseShape.of(model.args))
    return cfg, init_adapter_tensors(cfg, seed=1, zero_init_b=False, b_std=0.2)


def _gen(model, policy):
    return bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=20, policy=policy, block_size=4, tau=0.5,
                           min_prefix=2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("offload", [False, True], ids=["all-on-device", "half-on-cpu"])
def test_wgpu_equals_torch_backend(device_runner, family, offload):
    hf = tiny_model(family, num_hidden_layers=4, **VARIED[family][0])
    ref = bitmtp.load(hf, quantize="ternary", adapter=None)
    adapter = _adapter(ref, DRAFTER[family])
    ref.load_adapter(adapter)
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, backend="wgpu", cpu_layers=2 if offload else None)
    dev.load_adapter(adapter)
    assert dev.plan.gpu_layers == ([0, 1] if offload else [0, 1, 2, 3])
    ar = _gen(ref, "ar").token_ids
    assert len(ar) == 20 and len(set(ar)) >= 8, ar  # a long, varied continuation (VARIED)
    for policy in ("ar", "speculative", "hybrid"):
        want = _gen(ref, policy)
        before = device_runner.reads
        got = _gen(dev, policy)
        assert got.token_ids == want.token_ids, policy
        assert got.stats.committed == want.stats.committed  # same iterations, same commits
        if policy == "speculative":
            assert got.token_ids == ar
        if not offload:  # one device read per engine read: prefill + one per iteration (+ a final flush)
            assert device_runner.reads - before == got.stats.syncs
            assert got.stats.syncs <= got.stats.iterations + 2


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_shaders_end_to_end(device_runner, monkeypatch, family):
    """The shaders a GPU adapter gets (w2a8.wgsl and dense.wgsl; CPU adapters default to the rows
    shaders) give the torch backend's greedy output too, for ar / speculative / hybrid."""
    monkeypatch.setenv("BITMTP_WGPU_W2A8", "tiled")
    monkeypatch.setenv("BITMTP_WGPU_DENSE", "tiled")
    hf = tiny_model(family, num_hidden_layers=2, **VARIED[family][0])
    ref = bitmtp.load(hf, quantize="ternary", adapter=None)
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, backend="wgpu")
    adapter = _adapter(ref, DRAFTER[family])
    ref.load_adapter(adapter)
    dev.load_adapter(adapter)
    for policy in ("ar", "speculative", "hybrid"):
        assert _gen(dev, policy).token_ids == _gen(ref, policy).token_ids, policy
    used = {id(cmd[0]) for run in dev.engine.pool.runners.values() if run.captured for cmd in run.captured.commands}
    shaders = {key[0] for key, pipe in device_runner._pipelines.items() if id(pipe) in used}
    assert {"w2a8", "dense"} <= shaders and not shaders & {"w2a8_rows", "dense_rows"}, shaders


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_steps_replay_the_same_commands(device_runner, monkeypatch, family):
    """A runner replays its step from a recording once two runs recorded the same commands: the output
    equals the eager wgpu backend's (BITMTP_EAGER=1: every step runs its Python) for ar / speculative /
    hybrid, with the same dispatches, also while another model with the same replay states (so the same
    arenas) but a wider MLP (so other values in its uniform slots) runs in between; steps with
    CPU-offloaded layers are never replayed."""
    policies = ("ar", "speculative", "hybrid", "ar")

    def load(which, **kw):
        m = bitmtp.load(tiny_model(family, num_hidden_layers=4, **VARIED[family][which]),
                        quantize="ternary", adapter=None, backend="wgpu", **kw)
        m.load_adapter(_adapter(m, DRAFTER[family]))
        return m

    def one(model, policy):
        g = _gen(model, policy)
        return g.token_ids, g.stats.committed

    def run_all(model):
        before = device_runner.dispatches
        return [one(model, p) for p in policies], device_runner.dispatches - before

    monkeypatch.setenv("BITMTP_EAGER", "1")
    eager_a, eager_b = load(0), load(1)
    want_a, want_dispatches = run_all(eager_a)
    want_b, _ = run_all(eager_b)
    assert want_a[0][0] != want_b[0][0] and len(set(want_a[0][0])) >= 8 and len(set(want_b[0][0])) >= 8
    assert not any(r.captured for r in eager_a.engine.pool.runners.values())
    monkeypatch.delenv("BITMTP_EAGER")
    a = load(0)
    got_a, dispatches = run_all(a)
    assert got_a == want_a
    assert dispatches == want_dispatches  # replays encode exactly what the Python encodes
    runners = a.engine.pool.runners.values()
    assert sum(r.replayed for r in runners) > 20  # most steps of the 4 generations came from recordings
    assert all(r.replayed <= r.replays - 2 for r in runners)  # two agreeing recordings before a replay
    b = load(1)
    for _ in range(2):  # interleaved: each model's steps rewrite the shared arenas' uniforms
        assert [one(a, p) for p in policies] == want_a
        assert [one(b, p) for p in policies] == want_b
    offloaded = load(0, cpu_layers=2)
    assert [t for t, _ in run_all(offloaded)[0]] == [t for t, _ in want_a]
    assert not any(r.captured or r.replayed for r in offloaded.engine.pool.runners.values())


def test_dense_model_and_plan(device_runner):
    """A dense (non-ternary) model runs through the dense shader; the plan says where everything is."""
    hf = tiny_model("llama", seed=3)
    ref = bitmtp.load(hf, adapter=None)
    dev = bitmtp.load(hf, adapter=None, backend="wgpu", vram_budget="64MiB")
    assert _gen(dev, "ar").token_ids == _gen(ref, "ar").token_ids
    table = dev.plan.table()
    assert "2 of 2 layers on the GPU" in table and dev.plan.fits


def test_budget_too_small_shows_the_plan(device_runner):
    with pytest.raises(BitMTPError, match="minimum budget") as info:
        bitmtp.load(tiny_model("bitnet", seed=4), quantize="ternary", adapter=None, backend="wgpu",
                    vram_budget=100_000)
    assert "component" in str(info.value) and "layers" in str(info.value)  # the failed plan's table


def test_no_vulkan_adapter_names_the_package_and_shows_the_plan(monkeypatch):
    from bitmtp.wgsl_fallback import runner as runner_mod

    def no_adapter():
        raise BackendUnavailableError(f"wgpu backend: {runner_mod.VULKAN_HINT}")

    monkeypatch.setattr(runner_mod, "default_runner", no_adapter)
    with pytest.raises(BackendUnavailableError, match="mesa-vulkan-drivers") as info:
        bitmtp.load(tiny_model("llama", seed=5), quantize="ternary", adapter=None, backend="wgpu")
    assert "The plan that could not run" in str(info.value) and "layers 0-1" in str(info.value)


def test_tensor_beyond_device_limits_names_it(device_runner, monkeypatch):
    from bitmtp.wgsl_fallback import runner as runner_mod

    small = runner_mod.Runner(max_binding_bytes=256)  # a KV row (kv_heads x rows x head_dim) is larger
    monkeypatch.setattr(runner_mod, "default_runner", lambda: small)
    with pytest.raises(BitMTPError, match="cannot be split by rows") as info:
        bitmtp.load(tiny_model("qwen3", seed=6), quantize="ternary", adapter=None, backend="wgpu")
    assert "component" in str(info.value)


def test_bad_wgpu_arguments(device_runner):
    hf = tiny_model("llama", seed=7)
    with pytest.raises(BitMTPError, match="only meaningful with backend='wgpu'"):
        bitmtp.load(hf, adapter=None, vram_budget="1GB")
    with pytest.raises(BitMTPError, match="vram_budget|budget"):
        bitmtp.load(hf, adapter=None, backend="wgpu", vram_budget="lots")
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, backend="wgpu")
    from bitmtp.decoding.drafters import OracleDrafter

    oracle = OracleDrafter(dev.decoder, PROMPT + [0] * 40)
    with pytest.raises(BitMTPError, match="oracle drafter does not run on the device"):
        bitmtp.generate(dev, input_ids=PROMPT, max_new_tokens=5, policy="speculative", block_size=4, drafter=oracle)


def test_cli_generate_and_plan(device_runner, tmp_path, capsys):
    from bitmtp import cli

    folder = tmp_path / "m"
    tiny_model("llama", seed=8).save_pretrained(folder)
    argv = ["generate", "--model", str(folder), "--input-ids", "5,6,7", "--max-new-tokens", "6", "--json",
            "--quantize", "ternary"]
    assert cli.main(argv) == 0
    import json

    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert cli.main(argv + ["--backend", "wgpu", "--vram-budget", "1GB", "--cpu-layers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert cli.main(["info", "--plan", "--preset", "llama3-8b-1.58"]) == 0
    out = capsys.readouterr().out
    assert "Offload plan for llama3-8b-1.58" in out and "on the CPU" in out
    assert cli.main(["info", "--plan", "--preset", "nope"]) == 2
    assert "preset" in capsys.readouterr().err


def test_long_prompt_several_prefill_chunks_and_arena_reuse(device_runner):
    """150 prompt tokens = prefill chunks of 64, 64, 22: two steps of one replay state recorded before any
    read (their token uploads and reused arena buffers must not clobber each other)."""
    hf = tiny_model("bitnet", seed=9)
    prompt = [(7 * i) % 97 for i in range(1, 151)]
    want = bitmtp.load(hf, quantize="ternary", adapter=None).generate_ar(prompt, 12).tokens
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, backend="wgpu")
    assert dev.generate_ar(prompt, 12).tokens == want
    assert dev.generate_ar(prompt, 12).tokens == want  # again: every arena slot reused

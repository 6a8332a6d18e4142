"""The Vulkan runtime end to end (``bitmtp.load(..., runtime="vulkan")``, bitmtp/runtime/vulkan/): whole
layers on a Vulkan device.

Rules: greedy output equals the torch runtime's token for token, for tiny ternary models of the three
families, with ar / speculative / hybrid, with no layers offloaded and with half of them on the CPU; a
decode iteration reads back once (counted on the device runner); bad input raises BitMTPError showing the
plan. Also: choosing the runtime (``runtime=``, the deprecated ``runtime="vulkan"`` warning once), both
runtimes' pools and runners satisfying ``bitmtp.runtime.protocols``, and the layer-spec check (a family
with an activation the device model lacks is refused at load; an extra norm slot it has runs). Runs on
Mesa lavapipe in CI (BITMTP_REQUIRE_WGPU=1 turns a missing adapter into a failure).
"""

from __future__ import annotations

import pytest

import bitmtp
from bitmtp.errors import BackendUnavailableError, BitMTPError
from bitmtp.formats.adapters import AdapterConfig, BaseShape
from bitmtp.model.adapters import init_adapter_tensors
from bitmtp.model.families import NORM_NAMES, PROJECTIONS, Activation, Family, Norm, UnsupportedLayer
from tests.support.hf_models import FAMILIES, tiny_model
from tests.support.wgpu_device import device_runner_or_skip

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
def test_vulkan_equals_torch_runtime(device_runner, family, offload):
    hf = tiny_model(family, num_hidden_layers=4, **VARIED[family][0])
    ref = bitmtp.load(hf, quantize="ternary", adapter=None)
    adapter = _adapter(ref, DRAFTER[family])
    ref.load_adapter(adapter)
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan", cpu_layers=2 if offload else None)
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
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan")
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
    equals the eager Vulkan runtime's (BITMTP_EAGER=1: every step runs its Python) for ar / speculative /
    hybrid, with the same dispatches, also while another model with the same replay states (so the same
    arenas) but a wider MLP (so other values in its uniform slots) runs in between; steps with
    CPU-offloaded layers are never replayed."""
    policies = ("ar", "speculative", "hybrid", "ar")

    def load(which, **kw):
        m = bitmtp.load(tiny_model(family, num_hidden_layers=4, **VARIED[family][which]),
                        quantize="ternary", adapter=None, runtime="vulkan", **kw)
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
    dev = bitmtp.load(hf, adapter=None, runtime="vulkan", vram_budget="64MiB")
    assert _gen(dev, "ar").token_ids == _gen(ref, "ar").token_ids
    table = dev.plan.table()
    assert "2 of 2 layers on the GPU" in table and dev.plan.fits


@pytest.mark.parametrize("tie", [False, True])
def test_half_checkpoint_uploads_its_half_rows(device_runner, tie):
    """A bf16 checkpoint loaded for float32 compute holds bf16 rows (no float32 copy on the host) and uploads them
    as they are (the planner counts 2 bytes a dense weight); greedy tokens equal the CPU runtime's."""
    import torch

    hf = tiny_model("llama", seed=3, tie_word_embeddings=tie).to(torch.bfloat16)
    ref = bitmtp.load(hf, adapter=None)
    dev = bitmtp.load(hf, adapter=None, runtime="vulkan", vram_budget="64MiB")
    head = dev.decoder.lm_head
    assert head.lazy and head.blocks.fmt == "bf16"
    assert _gen(dev, "ar").token_ids == _gen(ref, "ar").token_ids
    assert head.lazy, "the upload made a float32 copy of the half rows"
    on_device = dev.engine.pool.model
    assert on_device.lm_head.weight.kind == "bf16" and on_device.embed.kind == "bf16"
    assert dev.plan.dense_dtype_bytes == 2


def test_budget_too_small_shows_the_plan(device_runner):
    with pytest.raises(BitMTPError, match="minimum budget") as info:
        bitmtp.load(tiny_model("bitnet", seed=4), quantize="ternary", adapter=None, runtime="vulkan",
                    vram_budget=100_000)
    assert "component" in str(info.value) and "layers" in str(info.value)  # the failed plan's table


def test_no_vulkan_adapter_names_the_package_and_shows_the_plan(monkeypatch):
    from bitmtp.wgsl_fallback import runner as runner_mod

    def no_adapter():
        raise BackendUnavailableError(f"wgpu backend: {runner_mod.VULKAN_HINT}")

    monkeypatch.setattr(runner_mod, "default_runner", no_adapter)
    with pytest.raises(BackendUnavailableError, match="mesa-vulkan-drivers") as info:
        bitmtp.load(tiny_model("llama", seed=5), quantize="ternary", adapter=None, runtime="vulkan")
    assert "The plan that could not run" in str(info.value) and "layers 0-1" in str(info.value)


def test_tensor_beyond_device_limits_names_it(device_runner, monkeypatch):
    from bitmtp.wgsl_fallback import runner as runner_mod

    small = runner_mod.Runner(max_binding_bytes=256)  # a KV row (kv_heads x rows x head_dim) is larger
    monkeypatch.setattr(runner_mod, "default_runner", lambda: small)
    with pytest.raises(BitMTPError, match="cannot be split by rows") as info:
        bitmtp.load(tiny_model("qwen3", seed=6), quantize="ternary", adapter=None, runtime="vulkan")
    assert "component" in str(info.value)


def test_bad_vulkan_arguments(device_runner):
    hf = tiny_model("llama", seed=7)
    with pytest.raises(BitMTPError, match="only meaningful with runtime='vulkan'"):
        bitmtp.load(hf, adapter=None, vram_budget="1GB")
    with pytest.raises(BitMTPError, match="vram_budget|budget"):
        bitmtp.load(hf, adapter=None, runtime="vulkan", vram_budget="lots")
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan")
    from bitmtp.decoding.drafters import OracleDrafter

    oracle = OracleDrafter(dev.decoder, PROMPT + [0] * 40)
    with pytest.raises(BitMTPError, match="oracle drafter does not run on the device"):
        bitmtp.generate(dev, input_ids=PROMPT, max_new_tokens=5, policy="speculative", block_size=4, drafter=oracle)
    # sampling: the step shader ends in an argmax; refused before anything runs, greedy still fine after
    ref = bitmtp.generate(dev, input_ids=PROMPT, max_new_tokens=5, policy="ar").token_ids
    for kw in (dict(temperature=0.7), dict(repetition_penalty=1.2)):
        with pytest.raises(BitMTPError, match="^sampling: runtime='vulkan' decodes greedily only"):
            bitmtp.generate(dev, input_ids=PROMPT, max_new_tokens=5, policy="ar", **kw)
    assert not dev.engine.busy
    assert bitmtp.generate(dev, input_ids=PROMPT, max_new_tokens=5, policy="ar", temperature=0.0, top_p=0.5,
                           seed=3).token_ids == ref


def test_cli_generate_and_plan(device_runner, tmp_path, capsys):
    from bitmtp import cli

    folder = tmp_path / "m"
    tiny_model("llama", seed=8).save_pretrained(folder)
    argv = ["generate", "--model", str(folder), "--input-ids", "5,6,7", "--max-new-tokens", "6", "--json",
            "--quantize", "ternary"]
    assert cli.main(argv) == 0
    import json

    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert cli.main(argv + ["--runtime", "vulkan", "--vram-budget", "1GB", "--cpu-layers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert cli.main(argv + ["--backend", "wgpu", "--vram-budget", "1GB"]) == 0  # the deprecated spelling
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert cli.main(argv + ["--vram-budget", "1GB"]) == 2  # a Vulkan option without the Vulkan runtime
    assert "--runtime vulkan" in capsys.readouterr().err
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    runtimes = out[out.index("runtimes (--runtime):"):].splitlines()[1:3]
    assert runtimes[0].split()[:2] == ["yes", "torch"] and runtimes[1].split()[:2] == ["yes", "vulkan"], runtimes
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
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan")
    assert dev.generate_ar(prompt, 12).tokens == want
    assert dev.generate_ar(prompt, 12).tokens == want  # again: every arena slot reused


# --- choosing the runtime -------------------------------------------------------------------------


def test_runtime_selects_the_step_pool(device_runner):
    """``runtime=`` picks the engine's pool: the torch GraphPool by default, the Vulkan pool for "vulkan"
    (with its plan); an unknown runtime or a Vulkan option without it is refused naming the argument."""
    from bitmtp.runtime.graphs import GraphPool
    from bitmtp.runtime.vulkan.device import VulkanStepPool

    hf = tiny_model("qwen3", seed=11)
    torch_model = bitmtp.load(hf, quantize="ternary", adapter=None)
    assert torch_model.engine.runtime == "torch" and type(torch_model.engine.pool) is GraphPool
    assert torch_model.plan is None
    dev = bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan")
    assert dev.engine.runtime == "vulkan" and type(dev.engine.pool) is VulkanStepPool
    assert dev.plan.gpu_layers == list(range(dev.args.num_layers))
    assert _gen(dev, "ar").token_ids == _gen(torch_model, "ar").token_ids
    with pytest.raises(BitMTPError, match="session: a runtime='vulkan' model"):  # unchanged
        dev.session()
    for bad in ("wgpu", "Vulkan", "cuda", None, 1):
        with pytest.raises(BitMTPError, match=r"runtime: expected one of 'torch', 'vulkan'.*got"):
            bitmtp.load(hf, adapter=None, runtime=bad)
    for kw in (dict(vram_budget="1GB"), dict(cpu_layers=1)):
        with pytest.raises(BitMTPError, match="only meaningful with runtime='vulkan'.*add runtime='vulkan'"):
            bitmtp.load(hf, adapter=None, runtime="torch", **kw)


def test_backend_wgpu_warns_once_and_runs_the_vulkan_runtime(device_runner, monkeypatch, caplog, recwarn):
    """``backend="wgpu"`` still loads the Vulkan runtime (same tokens), and says to use runtime="vulkan"
    once per process: one DeprecationWarning and one log line for any number of loads."""
    import logging
    import warnings

    from bitmtp import api

    monkeypatch.setattr(api, "_WGPU_BACKEND_WARNED", False)  # as in a fresh process
    warnings.simplefilter("always", DeprecationWarning)  # count every emission, not the first per line
    hf = tiny_model("bitnet", seed=12, initializer_range=0.2)
    want = _gen(bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan"), "ar").token_ids
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    with caplog.at_level(logging.WARNING, logger="bitmtp"):
        models = [bitmtp.load(hf, quantize="ternary", adapter=None, backend="wgpu", cpu_layers=c) for c in (None, 1)]
    assert [m.engine.runtime for m in models] == ["vulkan", "vulkan"] and models[1].plan.cpu_layers == [1]
    assert all(_gen(m, "ar").token_ids == want for m in models)
    deprecations = [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and "runtime='vulkan'" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__  # points at the caller of load()
    logged = [r for r in caplog.records if "backend='wgpu' is deprecated" in r.getMessage()]
    assert len(logged) == 1 and "runtime='vulkan'" in logged[0].getMessage()


# --- the step-pool protocols -------------------------------------------------------------------------


def test_both_runtimes_implement_the_step_protocols(device_runner):
    """GraphPool (torch) and VulkanStepPool satisfy ``StepPool``, their runners ``StepRunner``; only the
    Vulkan runners have the on-device verify capability, and only while no layer is on the CPU. Objects
    missing a member do not pass (the protocols are not vacuous)."""
    from bitmtp.runtime.protocols import DeviceVerifyRunner, StepPool, StepRunner, runs_verify_on_device
    from bitmtp.runtime.states import ReplayState

    hf = tiny_model("llama", seed=13)
    models = {"torch": bitmtp.load(hf, quantize="ternary", adapter=None),
              "vulkan": bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan"),
              "offloaded": bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan", cpu_layers=1)}
    state = ReplayState(4, models["torch"].engine.kv.segment_for(4), "verify")
    for name, model in models.items():
        pool = model.engine.pool
        runner = pool.get(state)
        assert isinstance(pool, StepPool) and isinstance(runner, StepRunner), name
        assert isinstance(runner, DeviceVerifyRunner) == (name != "torch"), name
        assert runs_verify_on_device(runner) == (name == "vulkan"), name
        assert pool.capture is False  # no CUDA graphs here: no cross-session step lock

    class NoFlush:
        drafter, capture = None, False

        def get(self, state): ...

        def set_drafter(self, drafter): ...

    class NoRun:
        state = tokens = positions = out_token = out_prob = None

    assert not isinstance(NoFlush(), StepPool) and not isinstance(NoRun(), StepRunner)


# --- the layer spec -------------------------------------------------------------------------------


def _write_family_checkpoint(folder, family: str, seed: int):
    """A tiny checkpoint folder of a test-only family: config.json + random tensors named per
    ``NORM_NAMES`` / ``PROJECTIONS`` for the family's norm slots (so ``build_decoder`` reads them)."""
    import json

    import torch
    from safetensors.torch import save_file

    from bitmtp.model.args import ModelArgs
    from bitmtp.model.families import get_family, norm_size

    cfg = {"model_type": family, "architectures": [f"{family}ForCausalLM"], "vocab_size": 97, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "max_position_embeddings": 512, "tie_word_embeddings": True}
    args = ModelArgs.from_hf_config(cfg)
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (args.q_size, 64), "self_attn.k_proj": (args.kv_size, 64),
              "self_attn.v_proj": (args.kv_size, 64), "self_attn.o_proj": (64, args.q_size),
              "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64), "mlp.down_proj": (64, 96)}
    assert set(shapes) == set(PROJECTIONS)
    tensors = {"model.embed_tokens.weight": torch.randn(97, 64, generator=g) * 0.1,
               "model.norm.weight": 1 + 0.1 * torch.randn(64, generator=g)}
    for i in range(args.num_layers):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.3
        for slot in get_family(family).layer_norms:
            tensors[f"model.layers.{i}.{NORM_NAMES[slot][0]}"] = 1 + 0.3 * torch.randn(norm_size(slot, args),
                                                                                         generator=g)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return args, tensors


@pytest.fixture
def test_family(request):
    """Register a test-only family (``request.param``: its activation) with an extra norm after the MLP;
    unregistered afterwards."""
    from bitmtp.model.families import register_family, unregister_family

    act = request.param
    fam = register_family(Family(f"vk{act.name.lower()}", (f"vk{act.name.lower()}",),
                                 (f"vk{act.name.lower()}ForCausalLM",), f"vk{act.name.lower()}", (act,),
                                 frozenset({Norm.MLP_OUT})))
    yield fam
    unregister_family(fam.name)


@pytest.mark.parametrize("test_family", [Activation.GELU_TANH], indirect=True)
def test_unsupported_activation_is_refused_at_load(device_runner, tmp_path, test_family):
    """A family whose activation the Vulkan device model lacks (GELU) loads and runs on the torch runtime
    and is refused at ``load(..., runtime="vulkan")`` with UnsupportedLayer naming the runtime, the
    activation and the fix — before any plan or upload."""
    from bitmtp.model.loaders import build_decoder

    args, tensors = _write_family_checkpoint(tmp_path / "m", test_family.name, seed=1)
    assert build_decoder(args, tensors, source="test").spec.activation is Activation.GELU_TANH
    torch_model = bitmtp.load(tmp_path / "m", adapter=None)
    assert len(_gen(torch_model, "ar").token_ids) == 20
    with pytest.raises(UnsupportedLayer, match=r"Vulkan runtime.*'gelu_pytorch_tanh'.*runtime='torch'"):
        bitmtp.load(tmp_path / "m", adapter=None, runtime="vulkan")
    assert issubclass(UnsupportedLayer, BitMTPError)


@pytest.mark.parametrize("test_family", [Activation.SILU, Activation.RELU2], indirect=True)
def test_extra_norm_slot_runs_on_the_device(device_runner, tmp_path, test_family):
    """A family with one extra norm (MLP_OUT, after the MLP) and an activation the device model has runs on
    the Vulkan runtime with the torch runtime's tokens (dense weights; also ternarized), so the device
    model executes the layer spec's norm slots, not a fixed list."""
    _write_family_checkpoint(tmp_path / "m", test_family.name, seed=2)
    for quantize in (None, "ternary"):
        want = _gen(bitmtp.load(tmp_path / "m", adapter=None, quantize=quantize), "ar").token_ids
        assert len(set(want)) >= 5, want  # a varied continuation: the extra norm matters to it
        got = _gen(bitmtp.load(tmp_path / "m", adapter=None, quantize=quantize, runtime="vulkan"), "ar").token_ids
        assert got == want, quantize

"""The Vulkan runtime's VRAM budget planner (bitmtp/runtime/vulkan/planner.py, issue #8) and the CLI's
model presets (bitmtp/cli_presets.py).

Expected byte counts are derived here from the model shapes, independently of the planner's own
tensor lists, and the per-layer accounting is checked against a real (tiny) loaded decoder.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from bitmtp.cli_presets import PRESETS
from bitmtp.errors import BitMTPError
from bitmtp.model.args import ModelArgs
from bitmtp.model.families import Activation, Family, Norm, register_family, unregister_family
from bitmtp.runtime.vulkan.planner import (
    DEFAULT_VRAM_BUDGET,
    LAVAPIPE_MAX_BINDING_BYTES,
    OffloadPlan,
    check_device_limits,
    parse_bytes,
    plan_offload,
)

BITNET, LLAMA8B, SMOL = PRESETS["bitnet-b1.58-2b-4t"], PRESETS["llama3-8b-1.58"], PRESETS["smollm2-135m"]
MIB = 2**20


# --- independent byte formulas ------------------------------------------------------------------


def proj_shapes(a: ModelArgs) -> list[tuple[int, int]]:
    h, i, q, kv = a.hidden_size, a.intermediate_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]  # q k v o gate up down: (N, K)


def weight_bytes(a: ModelArgs, ternary: bool = True, dense: int = 2) -> int:
    if ternary:  # T2 words + one float32 scale per tensor
        return sum(n * math.ceil(k / 16) * 4 + 4 for n, k in proj_shapes(a))
    return sum(n * k * dense for n, k in proj_shapes(a))


def norm_bytes(a: ModelArgs) -> int:
    n = 2 * a.hidden_size
    if a.family == "qwen3":
        n += 2 * a.head_dim
    if a.family == "bitnet":
        n += a.num_heads * a.head_dim + a.intermediate_size
    return 4 * n


def kv_bytes(a: ModelArgs, capacity: int, m_max: int, kv: int = 2) -> int:
    return 2 * a.num_kv_heads * (capacity + m_max) * a.head_dim * kv


def layer_bytes(a: ModelArgs, capacity: int = 2048, m_max: int = 31, ternary: bool = True) -> int:
    return weight_bytes(a, ternary) + norm_bytes(a) + kv_bytes(a, capacity, m_max)


def workspace_bytes(a: ModelArgs, capacity: int = 2048, m_max: int = 31) -> int:
    m, s, h, i, v = m_max, capacity + m_max, a.hidden_size, a.intermediate_size, a.vocab_size
    q, kv, heads = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_heads
    return (2 * m * h * 4 + m * max(h, q, i) + m * 4 + m * (q + 2 * kv) * 4 + m * q * 4 + heads * m * s * 4
            + m * s * 4 + m * 2 * i * 4 + m * i * 4 + 2 * s * (a.head_dim // 2) * 4 + m * v * 4 + m * 8
            + 3 * m * 4 + 4)


def lm_head_bytes(a: ModelArgs, dense: int = 2) -> int:
    return a.vocab_size * a.hidden_size * dense + a.hidden_size * 4  # + final norm


def device_head_bytes(a: ModelArgs, dense: int = 2) -> int:
    """LM head + final norm, plus the embedding table when it is not tied (the device gathers rows from it)."""
    return lm_head_bytes(a, dense) + (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size * dense)


def expected_gpu_layers(a: ModelArgs, budget: int, **kw) -> tuple[bool, int]:
    ws, lay, head = workspace_bytes(a, kw.get("capacity", 2048)), layer_bytes(a, **kw), device_head_bytes(a)
    head_on = ws + head + lay <= budget
    return head_on, min(a.num_layers, (budget - ws - (head if head_on else 0)) // lay)


def assert_consistent(plan: OffloadPlan) -> None:
    """Structure every plan must have: GPU layers 0..g-1, the CPU tail, byte totals, maximality."""
    a = plan.args
    g = len(plan.gpu_layers)
    assert plan.gpu_layers == list(range(g)) and plan.cpu_layers == list(range(g, a.num_layers))
    layers = [plan.entry(f"layer.{i}") for i in range(a.num_layers)]
    assert [e.device for e in layers] == ["gpu"] * g + ["cpu"] * (a.num_layers - g)
    assert plan.gpu_bytes == sum(e.bytes for e in plan.entries if e.device == "gpu")
    assert plan.gpu_bytes <= plan.budget
    assert plan.entry("embeddings").device == ("gpu" if plan.lm_head_on_gpu else "host")
    assert plan.fits == (not plan.cpu_layers and plan.lm_head_on_gpu)


def assert_maximal(plan: OffloadPlan) -> None:
    if plan.cpu_layers:
        assert plan.gpu_bytes + plan.layer_bytes > plan.budget, "one more GPU layer would still fit"


# --- plans of the presets -----------------------------------------------------------------------


def test_bitnet_2b_fits_in_3_9_gb():
    plan = plan_offload(BITNET)
    total = workspace_bytes(BITNET) + lm_head_bytes(BITNET) + BITNET.num_layers * layer_bytes(BITNET)
    assert total <= DEFAULT_VRAM_BUDGET == 3_900_000_000  # derived: the whole model fits
    assert plan.budget == DEFAULT_VRAM_BUDGET
    assert plan.gpu_layers == list(range(30)) and plan.cpu_layers == []
    assert plan.lm_head_on_gpu and plan.fits
    assert plan.gpu_bytes == total
    assert plan.layer_bytes == layer_bytes(BITNET)
    assert plan.entry("workspace").bytes == workspace_bytes(BITNET)
    assert plan.entry("embeddings").bytes == 0  # tied: gathered from the LM head's device copy
    assert_consistent(plan)
    assert "30 of 30 layers on the GPU" in plan.table()


def test_8b_at_3_9_gb_matches_derived_placement():
    plan = plan_offload(LLAMA8B)
    head_on, g = expected_gpu_layers(LLAMA8B, DEFAULT_VRAM_BUDGET)
    assert head_on and 0 < g < LLAMA8B.num_layers  # derived: the untied 8B model spills a tail to the CPU
    assert plan.lm_head_on_gpu == head_on and len(plan.gpu_layers) == g
    assert_consistent(plan)
    assert_maximal(plan)


@pytest.mark.parametrize("kw", [dict(capacity=8192), dict(ternary=False)], ids=["8k-context", "dense"])
def test_8b_spills_to_cpu_and_plan_is_maximal(kw):
    plan = plan_offload(LLAMA8B, **kw)
    head_on, g = expected_gpu_layers(LLAMA8B, DEFAULT_VRAM_BUDGET, **kw)
    assert 0 < g < LLAMA8B.num_layers  # derived: a partial offload
    assert plan.lm_head_on_gpu == head_on and plan.gpu_layers == list(range(g))
    assert plan.cpu_layers == list(range(g, LLAMA8B.num_layers)) and not plan.fits
    assert plan.layer_bytes == layer_bytes(LLAMA8B, **kw)
    assert_consistent(plan)
    assert_maximal(plan)
    n_cpu, move = len(plan.cpu_layers), 31 * LLAMA8B.hidden_size * 4
    assert plan.step_transfer_bytes == move
    verb = "moves" if n_cpu == 1 else "move"
    assert f"{n_cpu} layer{'' if n_cpu == 1 else 's'} on the CPU {verb} 31×4096×4 = {move} bytes" in plan.table()


def test_lm_head_goes_to_cpu_when_it_does_not_fit_with_a_layer():
    a = LLAMA8B
    budget = workspace_bytes(a) + device_head_bytes(a) + layer_bytes(a) - 1
    plan = plan_offload(a, budget)
    assert not plan.lm_head_on_gpu and plan.entry("lm_head").device == "cpu"
    assert len(plan.gpu_layers) == min(a.num_layers, (budget - workspace_bytes(a)) // layer_bytes(a))
    assert_consistent(plan)
    assert_maximal(plan)
    plan = plan_offload(a, budget + 1)
    assert plan.lm_head_on_gpu and plan.gpu_layers == [0]


def test_force_cpu_layers_half():
    half = BITNET.num_layers // 2
    plan = plan_offload(BITNET, force_cpu_layers=half)
    assert plan.gpu_layers == list(range(half)) and plan.cpu_layers == list(range(half, BITNET.num_layers))
    assert plan.gpu_bytes == workspace_bytes(BITNET) + lm_head_bytes(BITNET) + half * layer_bytes(BITNET)
    assert not plan.fits and "forced to the CPU" in plan.entry(f"layer.{BITNET.num_layers - 1}").notes
    assert_consistent(plan)
    assert plan_offload(BITNET, force_cpu_layers=0).fits
    with pytest.raises(BitMTPError, match="force_cpu_layers"):
        plan_offload(BITNET, force_cpu_layers=BITNET.num_layers)
    with pytest.raises(BitMTPError, match="force_cpu_layers"):
        plan_offload(BITNET, force_cpu_layers=-1)


def test_smollm2_and_json():
    plan = plan_offload(SMOL, name="smollm2-135m")
    assert plan.fits and plan.gpu_bytes == (workspace_bytes(SMOL) + lm_head_bytes(SMOL)
                                            + SMOL.num_layers * layer_bytes(SMOL))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["gpu_layers"] == list(range(30)) and d["budget"] == DEFAULT_VRAM_BUDGET and d["fits"] is True
    assert {e["name"] for e in d["entries"]} >= {"workspace", "lm_head", "embeddings", "layer.29"}
    assert all(set(e) == {"name", "device", "bytes", "chunks", "notes"} for e in d["entries"])


def test_table_is_aligned():
    plan = plan_offload(LLAMA8B, capacity=8192, name="llama3-8b-1.58")
    lines = plan.table().splitlines()
    assert lines[0].startswith("Offload plan for llama3-8b-1.58")
    body = [ln for ln in lines[1:-1] if not ln.startswith("-")]
    assert body[0].split()[:4] == ["component", "where", "MiB", "notes"]
    col = body[0].index("where")
    assert all(ln[col:].split()[0] in ("where", "gpu", "cpu", "host") for ln in body)
    mib_end = body[0].index("MiB") + 3
    assert all(ln[:mib_end].rstrip()[-1].isdigit() for ln in body[1:])  # right-aligned numbers
    assert "gathered from the uploaded token ids" in plan.table()  # the untied 8B model
    assert lines[-1] == plan.summary()


# --- accounting against a real loaded decoder --------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "bitnet"])
def test_layer_bytes_match_a_real_decoder(family):
    import bitmtp
    from bitmtp.runtime.kv import KVStore
    from tests.support.hf_models import tiny_model

    m = bitmtp.load(tiny_model(family), quantize="ternary", adapter=None)
    a, layer = m.args, m.decoder.layers[0]
    capacity, m_max = 256, 15
    plan = plan_offload(a, 10**9, capacity=capacity, m_max=m_max)
    specs = {t.name: t for t in plan.tensors}
    projs = [layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(p.weight.dtype == torch.int32 for p in projs)
    # the T2 words: exactly equal (fusion concatenates rows)
    real_words = sum(p.weight.numel() * p.weight.element_size() for p in projs)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sum(specs[f"layer.{n}"].nbytes for n in names) == real_words
    # scales: per tensor in the plan (7 × 4 bytes); fusing q|k|v and gate|up expands theirs to one per
    # row, while o_proj and down_proj keep one each
    assert sum(specs[f"layer.{n}.scales"].nbytes for n in names) == 7 * 4
    real_scales = sum(p.scales.numel() * p.scales.element_size() for p in projs)
    fused_rows = a.q_size + 2 * a.kv_size + 2 * a.intermediate_size
    assert real_scales == 4 * fused_rows + 4 + 4
    # norms in float32: exactly equal
    norms = [layer.norm(slot) for slot in Norm]
    real_norms = sum(t.numel() * 4 for t in norms if t is not None)
    assert all(t.dtype == torch.float32 for t in norms if t is not None)
    norm_names = [n for n in specs if n.startswith("layer.norm.")]
    assert len(norm_names) == sum(t is not None for t in norms)
    assert sum(specs[n].nbytes for n in norm_names) == real_norms
    # the KV cache: what KVStore allocates per layer in a 2-byte dtype
    store = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, capacity, m_max, dtype=torch.float16)
    assert specs["layer.k_cache"].nbytes + specs["layer.v_cache"].nbytes == store.nbytes // a.num_layers
    # and the whole layer, with the scales counted per tensor
    assert plan.layer_bytes == real_words + 7 * 4 + real_norms + store.nbytes // a.num_layers


# --- binding limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["llama3-8b-1.58", "bitnet-b1.58-2b-4t"])
def test_lm_head_chunks_under_128_mib(preset):
    a, limit = PRESETS[preset], LAVAPIPE_MAX_BINDING_BYTES
    assert limit == 128 * MIB
    plan = plan_offload(a, max_binding_bytes=limit)
    row = a.hidden_size * 2
    assert a.vocab_size * row > limit
    expected = math.ceil(a.vocab_size / (limit // row))
    assert plan.chunks["lm_head"] == expected > 1
    assert plan.entry("lm_head").chunks == expected
    assert all(c == 1 for name, c in plan.chunks.items() if name != "lm_head")  # nothing else is that big
    assert f"lm_head ×{expected}" in plan.table()
    check_device_limits(plan, limit)  # every device tensor can be split
    assert all(c == 1 for c in plan_offload(a).chunks.values())  # no limit, no splits


def test_row_larger_than_the_binding_limit_is_an_error():
    a, capacity = LLAMA8B, 300_000  # one KV head slab: (capacity + 31) × 128 × 2 bytes > 64 MiB
    plan = plan_offload(a, parse_bytes("80GB"), capacity=capacity)
    slab = (capacity + 31) * a.head_dim * 2
    assert slab > 64 * MIB
    with pytest.raises(BitMTPError, match="layer.k_cache") as e:
        check_device_limits(plan, 64 * MIB)
    assert str(slab) in str(e.value) and plan.table() in str(e.value)
    with pytest.raises(BitMTPError, match="layer.k_cache"):
        plan_offload(a, parse_bytes("80GB"), capacity=capacity, max_binding_bytes=64 * MIB)
    with pytest.raises(BitMTPError, match="max_buffer_bytes"):
        check_device_limits(plan, 0)


# --- errors and parsing ------------------------------------------------------------------------


def test_budget_too_small_shows_the_plan_and_the_minimum():
    minimum = workspace_bytes(LLAMA8B) + layer_bytes(LLAMA8B)
    assert len(plan_offload(LLAMA8B, minimum).gpu_layers) == 1
    with pytest.raises(BitMTPError) as e:
        plan_offload(LLAMA8B, minimum - 1)
    msg = str(e.value)
    assert f"minimum budget is {minimum} bytes" in msg
    assert e.value.plan is not None and e.value.plan.table() in msg
    assert "component" in msg and "0 of 32 layers on the GPU" in msg


@pytest.mark.parametrize("budget", [0, -1, 3.9e9, "3.9GB", True, None])
def test_bad_budget(budget):
    with pytest.raises(BitMTPError, match="budget_bytes"):
        plan_offload(BITNET, budget)


@pytest.mark.parametrize("kw", [dict(capacity=0), dict(m_max=0), dict(capacity=2.5), dict(m_max=-3),
                                dict(kv_dtype_bytes=0), dict(max_binding_bytes=0)])
def test_bad_arguments(kw):
    with pytest.raises(BitMTPError, match=next(iter(kw))):
        plan_offload(BITNET, **kw)


@pytest.mark.parametrize("text,value", [
    ("3.9GB", 3_900_000_000), ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("3900000000", 3_900_000_000),
    ("3.9 gb", 3_900_000_000), ("128 MiB", 128 * 2**20), ("0.5KiB", 512), ("100B", 100), ("2G", 2 * 10**9),
    (" 7 ", 7), (4096, 4096),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "GB", "-1GB", "3.9XB", "1.5", "0.3B", "1e9", "4 GiB GiB", None, 2.5])
def test_parse_bytes_garbage(text):
    with pytest.raises(BitMTPError, match="bytes"):
        parse_bytes(text)


# --- the family registry and the presets --------------------------------------------------------


@pytest.fixture
def extra_norm_family():
    """A test-only family: llama's shape with one extra norm after the MLP (MLP_OUT, hidden-sized)."""
    fam = register_family(Family("plannertest", ("plannertest",), ("PlannerTestForCausalLM",), "plannertest",
                                 (Activation.SILU,), frozenset({Norm.MLP_OUT})))
    yield fam
    unregister_family(fam.name)


def test_planner_reads_the_norm_slots_from_the_family_registry(extra_norm_family):
    """A family registered elsewhere is planned with its own norm slots and sizes: one more
    hidden-sized float32 vector per layer than the same shape as llama, and nothing else changes."""
    shape = {k: v for k, v in SMOL.to_dict().items() if k not in ("family", "hidden_act")}
    llama = ModelArgs(family="llama", **shape)
    extra = ModelArgs(family="plannertest", **shape)
    base, more = plan_offload(llama, DEFAULT_VRAM_BUDGET), plan_offload(extra, DEFAULT_VRAM_BUDGET)
    assert more.layer_bytes - base.layer_bytes == 4 * SMOL.hidden_size
    specs = {t.name: t for t in more.tensors}
    assert specs["layer.norm.mlp_out"].shape == (SMOL.hidden_size,)
    assert {n for n in specs if n.startswith("layer.norm.")} == {"layer.norm.attn_in", "layer.norm.mlp_in",
                                                                 "layer.norm.mlp_out"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_use_the_family_default_activation(name):
    """The presets name no activation: a bitnet preset runs the family's relu2, llama ones silu."""
    a = PRESETS[name]
    assert a.layer_spec.activation == (Activation.RELU2 if a.family == "bitnet" else Activation.SILU)
    assert a.to_dict() == ModelArgs(**{k: v for k, v in a.to_dict().items() if k != "hidden_act"}).to_dict()

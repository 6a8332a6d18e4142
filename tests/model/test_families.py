"""The family registry and the layer spec (bitmtp.model.families).

A family that differs from llama by one activation (GELU, tanh approximation) and one extra norm (after the
MLP, Gemma-style) is ONE registration call here — nothing under bitmtp/ is patched. It must then load from
an HF-style checkpoint, run on the torch path equal to an independent float64 reference written below,
train one step through the training view, and be declined by the executors that lack its features (the
fused CPU layers decline with a reason and the per-op path runs; the Vulkan runtime refuses at load, see
the Vulkan runtime's tests). Rule: logits within 1e-4 of the float64 reference; greedy tokens equal.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

from bitmtp.errors import BitMTPError, FormatError
from bitmtp.model import families as F
from bitmtp.model.args import ModelArgs
from bitmtp.model.families import Activation, Family, LayerSpec, Norm, UnsupportedLayer
from tests.support.paths import REPO_ROOT as ROOT

GELU_FAMILY = Family("test-gelu-llama", ("test-gelu-llama",), ("TestGeluLlamaForCausalLM",), "test-gelu-llama",
                     (Activation.GELU_TANH,), frozenset({Norm.MLP_OUT}),
                     description="test only: llama with GELU and a norm after the MLP")
SHAPE = dict(vocab_size=61, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
             intermediate_size=80, rms_norm_eps=1e-5, max_position_embeddings=128)


@pytest.fixture
def gelu_family():
    F.register_family(GELU_FAMILY)
    yield GELU_FAMILY
    F.unregister_family(GELU_FAMILY.name)


def _tensors(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named tensors of a model with ``args``, named from the registry (projections + norm slots)."""
    g = torch.Generator().manual_seed(seed)
    fam = F.get_family(args.family)
    h = args.hidden_size
    out = {"model.embed_tokens.weight": torch.randn(args.vocab_size, h, generator=g),
           "model.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           "lm_head.weight": torch.randn(args.vocab_size, h, generator=g) * 0.3}
    shapes = {"self_attn.q_proj": (args.q_size, h), "self_attn.k_proj": (args.kv_size, h),
              "self_attn.v_proj": (args.kv_size, h), "self_attn.o_proj": (h, args.q_size),
              "mlp.gate_proj": (args.intermediate_size, h), "mlp.up_proj": (args.intermediate_size, h),
              "mlp.down_proj": (h, args.intermediate_size)}
    assert set(shapes) == set(F.PROJECTIONS)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            out[p + name + ".weight"] = torch.randn(*shape, generator=g) / math.sqrt(shape[1]) * 1.5
        for slot in fam.layer_norms:
            out[p + F.NORM_NAMES[slot][0]] = 1 + 0.3 * torch.randn(F.norm_size(slot, args), generator=g)
    return out


def _reference_logits(args: ModelArgs, t: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Full-sequence causal forward in float64, written from the family's description alone."""
    d = {k: v.double() for k, v in t.items()}
    eps, n, hd = args.rms_norm_eps, len(ids), args.head_dim

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    inv = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(x):
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    x = d["model.embed_tokens.weight"][ids]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, d[p + "input_layernorm.weight"])
        q = rope((h @ d[p + "self_attn.q_proj.weight"].T).view(n, args.num_heads, hd))
        k = rope((h @ d[p + "self_attn.k_proj.weight"].T).view(n, args.num_kv_heads, hd))
        v = (h @ d[p + "self_attn.v_proj.weight"].T).view(n, args.num_kv_heads, hd)
        rep = args.num_heads // args.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        att = torch.einsum("hqk,khd->qhd", s.masked_fill(~causal, -math.inf).softmax(-1), v).reshape(n, -1)
        x = x + att @ d[p + "self_attn.o_proj.weight"].T
        h = rms(x, d[p + "post_attention_layernorm.weight"])
        g = h @ d[p + "mlp.gate_proj.weight"].T
        gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
        y = (gelu * (h @ d[p + "mlp.up_proj.weight"].T)) @ d[p + "mlp.down_proj.weight"].T
        x = x + rms(y, d[p + "post_feedforward_layernorm.weight"])
    return rms(x, d["model.norm.weight"]) @ d["lm_head.weight"].T


def _checkpoint(folder: Path, family: Family, seed: int = 0) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    cfg = {"model_type": family.hf_model_types[0], "architectures": list(family.hf_architectures),
           "vocab_size": SHAPE["vocab_size"], "hidden_size": SHAPE["hidden_size"],
           "num_hidden_layers": SHAPE["num_layers"], "num_attention_heads": SHAPE["num_heads"],
           "num_key_value_heads": SHAPE["num_kv_heads"], "head_dim": SHAPE["head_dim"],
           "intermediate_size": SHAPE["intermediate_size"], "rms_norm_eps": SHAPE["rms_norm_eps"],
           "max_position_embeddings": SHAPE["max_position_embeddings"], "hidden_act": "gelu_pytorch_tanh",
           "tie_word_embeddings": False, "eos_token_id": 2}
    args = ModelArgs.from_hf_config(cfg)
    tensors = _tensors(args, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return args, tensors


def test_shipped_families_and_specs():
    assert {"llama", "qwen3", "bitnet"} <= set(F.family_names())
    assert F.get_family("bitnet").activation(None) is Activation.RELU2
    spec = ModelArgs(family="qwen3", **SHAPE).layer_spec
    assert spec == LayerSpec(Activation.SILU, frozenset({Norm.Q, Norm.K}))
    assert F.get_family("bitnet").layer_norms == (Norm.ATTN_IN, Norm.ATTN_SUB, Norm.MLP_IN, Norm.MLP_SUB)
    assert F.family_of_config(None, ["Qwen3ForCausalLM"]).name == "qwen3"
    assert F.family_of_gguf_arch("bitnet").name == "bitnet" and F.family_of_gguf_arch("gpt2") is None
    assert F.get_family("llama").permute_qk and not F.get_family("qwen3").permute_qk


def test_registry_errors(gelu_family):
    with pytest.raises(BitMTPError, match="clashes"):
        F.register_family(Family("other", ("test-gelu-llama",), (), "other-arch", (Activation.SILU,)))
    with pytest.raises(FormatError, match="unknown architecture 'nope'.*test-gelu-llama"):
        F.get_family("nope")
    with pytest.raises(FormatError, match="hidden_act: test-gelu-llama models run 'gelu_pytorch_tanh', got 'silu'"):
        ModelArgs(family="test-gelu-llama", hidden_act="silu", **SHAPE)
    with pytest.raises(BitMTPError, match="at least one activation"):
        Family("x", (), (), "x", ())
    with pytest.raises(BitMTPError, match="optional slots only"):
        Family("x", (), (), "x", (Activation.SILU,), frozenset({Norm.ATTN_IN}))


def test_layer_spec_check_names_executor_and_feature():
    spec = LayerSpec(Activation.GELU_TANH, frozenset({Norm.MLP_OUT, Norm.Q}))
    with pytest.raises(UnsupportedLayer, match="my executor: .*activation 'gelu_pytorch_tanh'"):
        spec.check("my executor", [Activation.SILU], Norm)
    with pytest.raises(UnsupportedLayer, match="my executor: .*norm\\(s\\) mlp_out"):
        spec.check("my executor", Activation, [Norm.Q])
    spec.check("everything", Activation, Norm)  # supported: no error


def test_test_family_runs_on_the_torch_path(gelu_family, tmp_path):
    import bitmtp

    args, tensors = _checkpoint(tmp_path / "ckpt", gelu_family)
    assert args.family == "test-gelu-llama" and args.layer_spec.activation is Activation.GELU_TANH
    model = bitmtp.load(tmp_path / "ckpt", adapter=None, capacity=64)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, args.vocab_size, (9,), generator=g).tolist()
    ref = _reference_logits(args, tensors, prompt)
    dec = model.decoder
    from bitmtp.model.decoder import StepInputs
    from bitmtp.runtime.kv import KVStore

    kv = KVStore(args.num_layers, args.num_kv_heads, args.head_dim, capacity=64, m_max=16)
    n = len(prompt)
    step = StepInputs(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    with torch.no_grad():
        ours = dec(step, kv)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)
    # greedy: each generated token is the reference's argmax after the previous ones
    out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=6, policy="ar", eos_token_id=[]).token_ids
    seq = list(prompt)
    for tok in out:
        assert tok == int(_reference_logits(args, tensors, seq)[-1].argmax())
        seq.append(tok)
    # the fused CPU layers lack GELU and the post-MLP norm: they decline with the reason, the per-op path runs
    assert dec.fused_plan() is None
    assert "fused CPU layers" in dec.fused_reason and "gelu_pytorch_tanh" in dec.fused_reason
    assert dec.last_path == "per-op" and dec.path_counts["fused"] == 0


def test_the_extra_norm_and_activation_matter(gelu_family, tmp_path):
    """The reference is sensitive to both features, so the test above would catch an executor skipping them."""
    args, tensors = _checkpoint(tmp_path / "c", gelu_family)
    prompt = [5, 9, 3, 17]
    ref = _reference_logits(args, tensors, prompt)
    bumped = dict(tensors)
    bumped["model.layers.1.post_feedforward_layernorm.weight"] = tensors[
        "model.layers.1.post_feedforward_layernorm.weight"] * 1.5
    assert (_reference_logits(args, bumped, prompt) - ref).abs().max() > 1e-3


def test_test_family_trains_one_step(gelu_family, tmp_path):
    from bitmtp.formats.adapters import AdapterConfig, BaseShape
    from bitmtp.model.adapters import init_adapter_tensors
    from bitmtp.model.loaders import build_decoder
    from bitmtp.train.forward import MaskBlockParams, TrainView

    args, tensors = _checkpoint(tmp_path / "c", gelu_family)
    dec = build_decoder(args, tensors, source="test")
    view = TrainView(dec, torch.float64)
    ids = [4, 8, 15, 16, 23, 42]
    n = len(ids)
    mask = torch.ones(1, n, n, dtype=torch.bool).tril()
    pos = torch.arange(n)
    with torch.no_grad():
        logits = view.logits(view.hidden(view.embed[ids][None], pos, mask))[0]
    torch.testing.assert_close(logits.double(), _reference_logits(args, tensors, ids), rtol=1e-6, atol=1e-6)
    cfg = AdapterConfig(kind="mask-block", block_size=4, rank=2, base=BaseShape.of(args))
    params = MaskBlockParams(cfg, init_adapter_tensors(cfg, seed=1, zero_init_b=False)).double()
    opt = torch.optim.SGD(params.parameters(), lr=0.05)
    target = torch.tensor(ids[1:] + [7])

    def loss_now():
        x = view.embed[ids][None].clone()
        x[0, 3:] = params.mask_embedding.to(x.dtype)
        h = view.hidden(x, pos, mask, lora=params, gate_from=3)
        return torch.nn.functional.cross_entropy(view.logits(h)[0, 3:], target[3:])

    before = loss_now()
    before.backward()
    grads = [p.grad for p in params.parameters()]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads) and any(gr.abs().sum() > 0 for gr in grads)
    opt.step()
    with torch.no_grad():
        assert loss_now() < before


def test_only_the_registry_reads_hidden_act():
    """``hidden_act`` is resolved by bitmtp/model/families.py alone; ModelArgs may only declare and assign it.
    A module branching on it itself (``relu2 if args.hidden_act == ...``) would run a new activation as the
    wrong one without a word."""
    bad = []
    for path in sorted((ROOT / "bitmtp").rglob("*.py")) + sorted((ROOT / "wgsl_fallback").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "bitmtp/model/families.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "hidden_act" and isinstance(node.ctx, ast.Load):
                bad.append(f"{rel}:{node.lineno} reads .hidden_act")
            elif isinstance(node, ast.Constant) and node.value == "hidden_act":
                bad.append(f"{rel}:{node.lineno} uses the key 'hidden_act'")
            elif isinstance(node, ast.keyword) and node.arg == "hidden_act" and rel != "bitmtp/model/args.py":
                bad.append(f"{rel}:{node.lineno} passes hidden_act=")
    assert not bad, "\n".join(bad)


def test_hidden_act_scan_catches_a_reader(tmp_path):
    """The scan above finds what it is meant to find (it is not vacuous)."""
    src = "def f(args):\n    return 'relu2' if args.hidden_act == 'relu2' else 'silu'\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.Attribute) and n.attr == "hidden_act" and isinstance(n.ctx, ast.Load)
               for n in ast.walk(tree))

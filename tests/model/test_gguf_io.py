"""GGUF export → load of whole models (bitmtp/model/gguf_io.py, ``BitMTPModel.save_gguf``, ``bitmtp.load``).

Rules: export → load gives logits equal within 1e-6 (they come out bit-identical: ternary codes and exact
float32 scales travel; dense tensors keep their dtype) and identical greedy tokens, for tiny models of the
three families, dense and ternary, in each ternary storage type (TQ2_0, Q4_0, F32), with and without an
MTP adapter; transformers' GGUF loader (a reader that ignores unknown keys and tensors) loads the plain
base model; bad files raise BitMTPError and no partial file is left.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import bitmtp
from bitmtp.errors import BitMTPError, FormatError
from bitmtp.formats import gguf as G
from bitmtp.formats.adapters import AdapterConfig, BaseShape
from bitmtp.model.adapters import init_adapter_tensors
from bitmtp.model.fuse import fuse_rows
from bitmtp.model.gguf_io import _Ternary, decoder_state
from bitmtp.ops import TernaryLinear
from tests.support.hf_models import FAMILIES, tiny_model
from tests.support.logits import full_logits

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("no_dynamo")

PROMPT = [1, 5, 7, 9, 11, 3, 4, 60]
#: hidden size → storage type of the ternary projections (K = hidden and 2·hidden)
LAYOUTS = {256: "TQ2_0", 64: "Q4_0", 48: "F32"}


def _adapter(model, kind, block_size=4, seed=1):
    cfg = AdapterConfig(kind=kind, block_size=block_size, rank=4, base=BaseShape.of(model.args))
    return cfg, init_adapter_tensors(cfg, seed=seed, zero_init_b=False, b_std=0.2)


def _gen(model, policy="ar", **kw):
    out = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=24, policy=policy, **kw)
    return out.token_ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantize", [None, "ternary"])
@pytest.mark.parametrize("hidden", sorted(LAYOUTS))
def test_export_load_is_exact(family, quantize, hidden, tmp_path):
    hf = tiny_model(family, seed=hidden, hidden_size=hidden, intermediate_size=2 * hidden)
    model = bitmtp.load(hf, quantize=quantize, adapter=None)
    kind = "mask-block" if family != "qwen3" else "heads"
    model.load_adapter(_adapter(model, kind))
    path = model.save_gguf(tmp_path / "m.gguf", progress=False)
    back = bitmtp.load(path)
    assert back.adapter_config == model.adapter_config  # armed from the file's speculative keys
    assert all(torch.equal(back.adapter_tensors[k], v) for k, v in model.adapter_tensors.items())
    la, lb = full_logits(model.decoder, PROMPT), full_logits(back.decoder, PROMPT)
    assert (la - lb).abs().max().item() <= 1e-6
    ar = _gen(model)
    assert _gen(back) == ar
    assert _gen(back, "speculative") == ar  # the packed adapter drafts; verification keeps AR's output
    assert _gen(back, "hybrid", tau=0.5) == _gen(model, "hybrid", tau=0.5)
    types = {t.type_name for n, t in G.read_gguf(path).tensors.items() if ".attn_q." in n}
    if quantize:
        assert types == {LAYOUTS[hidden]}
        assert isinstance(back.decoder.layers[0].attn.qkv_proj, TernaryLinear)
    else:
        assert types == {"F32"}


@pytest.mark.parametrize("group", [None, 32, 128, 256])
def test_per_row_and_per_group_scales_round_trip(group, tmp_path, rng):
    """Scales other than per-tensor: per-row (group=None) and per-group, in TQ2_0 (256) or Q4_0 (32, 128)."""
    model = bitmtp.load(tiny_model("qwen3", seed=2, hidden_size=256, intermediate_size=512), adapter=None)
    for layer in model.decoder.layers:
        parts = []
        for n_out in (model.args.q_size, model.args.kv_size, model.args.kv_size):
            lin = nn.Linear(256, n_out, bias=False)
            nn.init.normal_(lin.weight, generator=rng)
            gran = "row" if group is None else "group"
            parts.append(TernaryLinear.from_float(lin, granularity=gran, group_size=group))
        layer.attn.qkv_proj = fuse_rows(parts)
    path = model.save_gguf(tmp_path / "g.gguf", progress=False)
    back = bitmtp.load(path, adapter=None)
    la, lb = full_logits(model.decoder, PROMPT), full_logits(back.decoder, PROMPT)
    assert torch.equal(la, lb)
    q = G.read_gguf(path).tensors["blk.0.attn_q.weight"]
    assert q.type_name == ("TQ2_0" if group in (None, 256) else "Q4_0")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("quantize", [None, "ternary"])
def test_transformers_gguf_loader_reads_the_base_model(family, quantize, tmp_path):
    """A reader that ignores unknown keys and tensors (transformers) gets the plain base model: dense weights
    exactly, ternary ones as w · fp16(scale); the MTP tensors and exact scales are skipped."""
    from transformers import AutoModelForCausalLM

    over = {"head_dim": 128} if family == "qwen3" else {}  # transformers' qwen3 GGUF reader assumes head_dim 128
    hf = tiny_model(family, seed=4, hidden_size=256, intermediate_size=512, **over)
    model = bitmtp.load(hf, quantize=quantize, adapter=None)
    model.load_adapter(_adapter(model, "mask-block"))
    model.save_gguf(tmp_path / "t.gguf", progress=False)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="t.gguf", dtype=torch.float32)
    got = plain.state_dict()
    for name, value in decoder_state(model.decoder).items():
        if isinstance(value, _Ternary):
            s = value.scales.half().float().expand(value.codes.shape[0], -1)
            value = value.codes.float() * s.repeat_interleave(value.group_size, dim=1)
        assert torch.equal(got[name].float(), value.float()), name
    if quantize is None:
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            assert (plain(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5


def test_gguf_reader_lists_metadata_and_tensors(tmp_path):
    model = bitmtp.load(tiny_model("bitnet", seed=5, hidden_size=256, intermediate_size=512), quantize="ternary",
                        adapter=None)
    model.load_adapter(_adapter(model, "heads", block_size=6))
    model.save_gguf(tmp_path / "b.gguf", progress=False)
    reader = gguf.GGUFReader(str(tmp_path / "b.gguf"))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "bitnet"
    assert fields["bitmtp.speculative.architecture"] == "heads"
    assert fields["bitmtp.speculative.block_size"] == 6 and fields["bitmtp.speculative.num_heads"] == 5
    assert fields["bitmtp.speculative.rank"] == 4 and fields["bitmtp.speculative.projection_dim"] == 4
    assert fields["bitmtp.speculative.shared_lm_head"] is True
    assert abs(fields["bitmtp.speculative.discount_gamma"] - 0.8) < 1e-6
    assert fields["bitnet.block_count"] == 2 and fields["bitnet.embedding_length"] == 256
    names = {t.name: t.tensor_type.name for t in reader.tensors}
    assert names["blk.0.attn_q.weight"] == "TQ2_0" and names["blk.1.ffn_down.weight"] == "TQ2_0"
    assert names["blk.0.attn_sub_norm.weight"] == "F32" and "bitmtp.scale.blk.0.attn_q" in names
    assert {f"bitmtp.mtp.heads.{k}.{p}" for k in range(5) for p in ("down", "up", "norm")} <= set(names)


def test_divine_file_arms_heads(tmp_path):
    """A file with Divine's keys and tensor names loads as a heads adapter that drafts like bitmtp's own."""
    model = bitmtp.load(tiny_model("llama", seed=6), adapter=None)
    cfg, tensors = _adapter(model, "heads", block_size=4)
    model.load_adapter((cfg, tensors))
    plain = model.save_gguf(tmp_path / "base.gguf", adapter=False, progress=False)
    contents = G.read_gguf(plain)
    assert not any(k.startswith("bitmtp.speculative.") for k in contents.meta)
    fields = dict(contents.fields)
    fields.update({"divine.speculative.architecture": G.field("mtp"), "divine.speculative.num_heads": G.field(3),
                   "divine.speculative.projection_dim": G.field(4), "divine.speculative.discount_gamma": G.field(0.9),
                   "divine.speculative.shared_lm_head": G.field(True)})
    parts = {"down": "proj_down.weight", "up": "proj_up.weight", "norm": "norm.weight"}
    outs = [G.TensorOut(t.name, np.asarray(t.data), None if t.type_name in ("F32", "F16") else t.type_name)
            for t in contents.tensors.values()]
    for name, t in tensors.items():
        _, k, part = name.split(".")
        outs.append(G.TensorOut(f"divine.mtp.{k}.{parts[part]}", t.numpy()))
    G.write_gguf(tmp_path / "divine.gguf", contents.architecture, fields.items(), outs)
    back = bitmtp.load(tmp_path / "divine.gguf")
    assert back.adapter_config.kind == "heads" and back.adapter_config.block_size == 4
    assert _gen(back, "speculative") == _gen(model, "speculative") == _gen(model)
    assert _gen(back, "confidence", tau=0.3) == _gen(model, "confidence", tau=0.3)
    assert bitmtp.load(plain).adapter_config is None  # no speculative keys: plain AR


def test_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 4, "def f(x): return x + 1"], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    model = bitmtp.load(tiny_model("llama", seed=7, vocab_size=300), adapter=None, tokenizer=tok)
    path = model.save_gguf(tmp_path / "tok.gguf", progress=False)
    back = bitmtp.load(path)
    text = "the lazy fox: def f(x)"
    assert back.encode(text) == model.encode(text)
    chat = [{"role": "user", "content": "quick dog"}]
    assert back.encode(chat) == model.encode(chat)
    meta = G.read_gguf(path).meta
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.tokens"]) == 300
    assert meta["tokenizer.ggml.tokens"][:3] == ["<pad>", "<s>", "</s>"]
    assert meta["tokenizer.ggml.token_type"][1] == 3 and meta["tokenizer.ggml.token_type"][299] == 5  # control, pad
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert meta["tokenizer.chat_template"] == tok.chat_template
    again = back.save_gguf(tmp_path / "again.gguf", progress=False)  # GGUF source: fields copied unchanged
    assert G.read_gguf(again).meta["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]


# --- bad input ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    model = bitmtp.load(tiny_model("llama", seed=8, hidden_size=256, intermediate_size=512), quantize="ternary",
                        adapter=None)
    model.load_adapter(_adapter(model, "heads", block_size=4))
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    return model, model.save_gguf(path, progress=False)


def _rewrite(src, dst, edit_fields=None, drop=()):
    contents = G.read_gguf(src)
    fields = dict(contents.fields)
    if edit_fields:
        edit_fields(fields)
    outs = [G.TensorOut(t.name, np.asarray(t.data), None if t.type_name in ("F32", "F16") else t.type_name)
            for t in contents.tensors.values() if t.name not in drop]
    return G.write_gguf(dst, contents.architecture, fields.items(), outs)


def test_truncated_file(small_file, tmp_path):
    data = small_file[1].read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 200):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(BitMTPError, match="truncated"):
            bitmtp.load(bad)


def test_unknown_tensor_type(small_file, tmp_path):
    data = bytearray(small_file[1].read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 0  # F32
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(BitMTPError, match="output_norm.weight.*unknown GGML type 250"):
        bitmtp.load(bad)


def test_inconsistent_speculative_metadata(small_file, tmp_path):
    def block8(f):
        f["bitmtp.speculative.block_size"] = G.field(8)

    with pytest.raises(FormatError, match="inconsistent metadata.*block_size"):
        bitmtp.load(_rewrite(small_file[1], tmp_path / "a.gguf", block8))

    def block8_no_config(f):
        block8(f)
        for k in ("bitmtp.speculative.config", "bitmtp.speculative.num_heads"):
            del f[k]

    with pytest.raises(BitMTPError, match="block_size=8"):
        bitmtp.load(_rewrite(small_file[1], tmp_path / "b.gguf", block8_no_config))
    with pytest.raises(BitMTPError, match="missing tensor 'heads.2.norm'"):
        bitmtp.load(_rewrite(small_file[1], tmp_path / "c.gguf", drop={"bitmtp.mtp.heads.2.norm"}))

    def wrong_args(f):
        args = json.loads(f[G.KEY_MODEL_ARGS].value)
        args["family"] = "qwen3"
        f[G.KEY_MODEL_ARGS] = G.field(json.dumps(args))

    with pytest.raises(FormatError, match="inconsistent metadata"):
        bitmtp.load(_rewrite(small_file[1], tmp_path / "d.gguf", wrong_args))
    assert bitmtp.load(small_file[1], adapter=None).adapter_config is None  # adapter=None: not armed


def test_inconsistent_scales_and_unknown_tensors(small_file, tmp_path):
    contents = G.read_gguf(small_file[1])
    fields = list(contents.fields.items())
    outs = []
    for t in contents.tensors.values():
        data = np.asarray(t.data)
        if t.name == "bitmtp.scale.blk.0.attn_v":
            data = data * 1.5
        outs.append(G.TensorOut(t.name, data, None if t.type_name in ("F32", "F16") else t.type_name))
    G.write_gguf(tmp_path / "s.gguf", "llama", fields, outs)
    with pytest.raises(FormatError, match="blk.0.attn_v.weight.*disagree"):
        bitmtp.load(tmp_path / "s.gguf")
    outs = [o for o in outs if o.name != "bitmtp.scale.blk.0.attn_v"]
    outs.append(G.TensorOut("blk.0.mystery.weight", np.ones((3, 4), np.float32)))
    G.write_gguf(tmp_path / "u.gguf", "llama", fields, outs)
    with pytest.raises(FormatError, match="unexpected tensor 'blk.0.mystery.weight'"):
        bitmtp.load(tmp_path / "u.gguf")


def test_unsupported_architecture(small_file, tmp_path):
    contents = G.read_gguf(small_file[1])
    outs = [G.TensorOut(t.name, np.asarray(t.data), None if t.type_name in ("F32", "F16") else t.type_name)
            for t in contents.tensors.values()]
    G.write_gguf(tmp_path / "gpt2.gguf", "gpt2", contents.fields.items(), outs)
    with pytest.raises(FormatError, match=r"\(general.architecture\) 'gpt2' is not supported \(supported: llama"):
        bitmtp.load(tmp_path / "gpt2.gguf")


def test_existing_output_and_no_partial_file(small_file, tmp_path, monkeypatch):
    model, src = small_file
    target = tmp_path / "out.gguf"
    target.write_bytes(b"keep me")
    with pytest.raises(BitMTPError, match="already exists"):
        model.save_gguf(target, progress=False)
    assert target.read_bytes() == b"keep me"

    calls = {"n": 0}
    real = G.encode_ternary

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(G, "encode_ternary", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        model.save_gguf(target, overwrite=True, progress=False)
    assert target.read_bytes() == b"keep me"  # the old file survives a failed overwrite
    fresh = tmp_path / "fresh.gguf"
    calls["n"] = 0
    with pytest.raises(RuntimeError):
        model.save_gguf(fresh, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]  # no partial or temporary file
    monkeypatch.setattr(G, "encode_ternary", real)
    model.save_gguf(target, overwrite=True, progress=False)
    assert G.read_gguf(target).meta["bitmtp.speculative.architecture"] == "heads"


def test_cli_convert(small_file, tmp_path, capsys):
    from bitmtp import cli

    model, _ = small_file
    folder = tmp_path / "hf"
    tiny_model("llama", seed=9).save_pretrained(folder)
    out = tmp_path / "cli.gguf"
    assert cli.main(["convert", str(folder), "--to", "gguf", "-o", str(out), "--quantize", "ternary"]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "Q4_0" in printed and "speculative: none" in printed
    assert cli.main(["convert", str(folder), "-o", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert cli.main(["convert", str(folder), "-o", str(tmp_path / "x.bin")]) == 2
    assert ".gguf" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(out), "--input-ids", "5,6,7", "--max-new-tokens", "5"]) == 0
    assert len(capsys.readouterr().out.split()) == 5


# --- the real model -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_gguf_smollm2_with_shipped_adapter(tmp_path):
    """SmolLM2-135M-Instruct + its shipped mask-block adapter → one GGUF → identical logits and tokens; the file
    arms the adapter by itself; transformers' GGUF loader reads the base model and agrees on the greedy tokens."""
    from transformers import AutoModelForCausalLM

    from tests.support.smollm2 import smollm2_or_skip

    src = smollm2_or_skip()
    model = bitmtp.load(src, capacity=512)
    assert model.adapter_config is not None  # the shipped adapter attached by fingerprint
    path = model.save_gguf(tmp_path / "smollm2-mtp.gguf", progress=False)
    back = bitmtp.load(path, capacity=512)
    assert back.adapter_config == model.adapter_config
    chat = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    ids = model.encode(chat)
    assert back.encode(chat) == ids and back.tokenizer.chat_template == model.tokenizer.chat_template
    la, lb = full_logits(model.decoder, ids), full_logits(back.decoder, ids)
    assert (la - lb).abs().max().item() <= 1e-6
    want = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, policy="ar")
    got = bitmtp.generate(back, input_ids=ids, max_new_tokens=64, policy="speculative", block_size=4)
    assert got.token_ids == want.token_ids and got.stats.mean_committed > 1
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = plain.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=64, do_sample=False, eos_token_id=None,
                             pad_token_id=plain.config.pad_token_id)[0, len(ids):].tolist()
    assert ref == back.generate_ar(ids, max_new_tokens=64, eos_token_id=[]).tokens


def test_plain_file_has_only_llama_cpp_tensors(tmp_path):
    model = bitmtp.load(tiny_model("bitnet", seed=10, hidden_size=256, intermediate_size=512), quantize="ternary",
                        adapter=None)
    model.load_adapter(_adapter(model, "mask-block"))
    path = model.save_gguf(tmp_path / "plain.gguf", plain=True, progress=False)
    contents = G.read_gguf(path)
    from bitmtp.model.families import BITNET

    assert all(BITNET.hf_name(n) is not None for n in contents.tensors)  # nothing llama.cpp would not create
    assert not any(k.startswith("bitmtp.speculative.") for k in contents.meta)
    back = bitmtp.load(path)
    assert back.adapter_config is None
    want = model.decoder.layers[1].mlp.down_proj
    got = back.decoder.layers[1].mlp.down_proj
    assert isinstance(got, TernaryLinear) and torch.equal(got.weight, want.weight)
    assert torch.equal(got.scales, want.scales.half().float())  # only the fp16 block scale travelled
    la, lb = full_logits(model.decoder, PROMPT), full_logits(back.decoder, PROMPT)
    assert (la - lb).abs().max().item() <= 5e-2 * la.abs().max().item()  # close, not exact: fp16 scales
    with pytest.raises(BitMTPError, match="plain"):
        from bitmtp.model.gguf_io import export_gguf

        export_gguf(model.decoder, tmp_path / "x.gguf", adapter=(model.adapter_config, model.adapter_tensors),
                    plain=True)

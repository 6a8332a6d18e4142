"""What the public API accepts and how it refuses the rest (issue 21, items 3 and 4).

Rules: ``input_ids`` is one sequence — a 1-D list / tuple / tensor / numpy array, or a ``[1, T]``
tensor / array / nested list — and every accepted form decodes exactly like the plain list; a
batch, a non-integer dtype, text or an id outside the vocabulary is a BitMTPError subclass naming
``input_ids``. The same for ``eos_token_id``, chat messages (naming the message index), ``device``,
``capacity`` / ``m_max`` (refused before anything of that size is allocated) and ``min_prefix``
(any m ≥ 0: m ≤ 1 is confidence, m > D speculative). A GGUF's embedded tokenizer files are data
only: a Python file, custom-code ``auto_map`` or a path is a FormatError and nothing runs.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError, DeviceError, DTypeError, FormatError, ShapeError, TokenIdError
from tests.support.adapters import INIT_RANGE, TAU, random_adapter
from tests.support.hf_models import tiny_model
from tests.support.tokenizers import trained_bpe

transformers = pytest.importorskip("transformers")

VOCAB = 97  # tiny_model's


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=5, initializer_range=INIT_RANGE), capacity=64, adapter=None)


@pytest.fixture
def prompt(rng):
    return torch.randint(3, VOCAB, (int(torch.randint(3, 20, (1,), generator=rng)),), generator=rng).tolist()


def _gen(model, **kw):
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("policy", "ar")
    kw.setdefault("eos_token_id", [])
    return bitmtp.generate(model, **kw).token_ids


# --- input_ids --------------------------------------------------------------------------------------

FORMS = {
    "tuple": tuple,
    "range-like iterator": lambda p: iter(p),
    "tensor int64 [T]": lambda p: torch.tensor(p),
    "tensor int32 [T]": lambda p: torch.tensor(p, dtype=torch.int32),
    "tensor [1, T]": lambda p: torch.tensor([p]),
    "numpy int64 [T]": lambda p: np.array(p, dtype=np.int64),
    "numpy uint16 [1, T]": lambda p: np.array([p], dtype=np.uint16),
    "nested list [[...]]": lambda p: [p],
    "numpy scalars": lambda p: [np.int64(t) for t in p],
    "0-d tensors": lambda p: [torch.tensor(t) for t in p],
}


@pytest.mark.parametrize("form", FORMS)
def test_input_id_forms_decode_like_the_list(model, prompt, form):
    want = _gen(model, input_ids=list(prompt))
    assert _gen(model, input_ids=FORMS[form](prompt)) == want
    # an independent check of the baseline itself: greedy AR on the engine
    assert model.generate_ar(prompt, max_new_tokens=12, eos_token_id=[]).tokens == want


BAD_IDS = [
    ("batch tensor", lambda p: torch.tensor([p, p]), ShapeError, r"input_ids: batch of 2 .*call once per row"),
    ("batch numpy", lambda p: np.array([p, p, p]), ShapeError, r"input_ids: batch of 3 .*call once per row"),
    ("batch nested list", lambda p: [p, p], ShapeError, r"input_ids: batch of 2: .*call once per row"),
    ("empty batch", lambda p: torch.zeros(0, 5, dtype=torch.long), ShapeError, "input_ids: batch of 0"),
    ("3-D", lambda p: torch.tensor([[p]]), ShapeError, r"input_ids: expected .*\[1, T\]"),
    ("0-D", lambda p: torch.tensor(p[0]), ShapeError, r"input_ids: expected .*\[T\]"),
    ("float tensor", lambda p: torch.tensor(p, dtype=torch.float32), DTypeError, "input_ids: .*dtype float32"),
    ("bool tensor", lambda p: torch.tensor(p) > 50, DTypeError, "input_ids: .*dtype bool"),
    ("float numpy", lambda p: np.array(p, dtype=np.float64), DTypeError, "input_ids: .*dtype float64"),
    ("bool numpy", lambda p: np.array(p) > 50, DTypeError, "input_ids: .*dtype bool"),
    ("float in list", lambda p: p[:-1] + [float(p[-1])], DTypeError, r"input_ids: element \d+ is .*float"),
    ("bool in list", lambda p: [True] + p, DTypeError, "input_ids: element 0 is True"),
    ("str", lambda p: "hello", DTypeError, "input_ids: got text"),
    ("dict", lambda p: {"input_ids": p}, DTypeError, r"input_ids: got a mapping.*\['input_ids'\]"),
    ("None inside", lambda p: p + [None], DTypeError, r"input_ids: element \d+ is None"),
    ("an int", lambda p: 5, DTypeError, "input_ids: expected a sequence"),
    ("negative", lambda p: p + [-1], TokenIdError, r"input_ids: token ids \[-1\] are outside"),
    ("vocab", lambda p: [VOCAB] + p, TokenIdError, rf"input_ids: token ids \[{VOCAB}\] are outside"),
    ("empty list", lambda p: [], BitMTPError, "input_ids: the prompt is empty"),
    ("empty [1, 0]", lambda p: torch.zeros(1, 0, dtype=torch.long), BitMTPError, "input_ids: the prompt is empty"),
]


@pytest.mark.parametrize("case, make, err, msg", BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_bad_input_ids(model, prompt, case, make, err, msg):
    with pytest.raises(err, match=msg) as info:
        _gen(model, input_ids=make(prompt))
    assert isinstance(info.value, BitMTPError)
    assert not model.engine.busy


def test_token_id_error_is_an_index_error():
    assert issubclass(TokenIdError, IndexError) and issubclass(TokenIdError, BitMTPError)
    assert bitmtp.TokenIdError is TokenIdError


# --- eos_token_id -------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["int", "list", "tuple", "tensor", "numpy", "np.int64", "0-d tensor"])
def test_eos_forms_stop_at_the_first_occurrence(model, prompt, form):
    free = _gen(model, input_ids=prompt, max_new_tokens=20)
    stop = free[7]
    want = free[: free.index(stop) + 1]  # EOS inclusive, first occurrence
    other = next(t for t in range(VOCAB) if t not in free)  # a second EOS id that never occurs
    eos = {"int": stop, "list": [other, stop], "tuple": (stop,), "tensor": torch.tensor([stop, other]),
           "numpy": np.array([stop]), "np.int64": np.int64(stop), "0-d tensor": torch.tensor(stop)}[form]
    assert _gen(model, input_ids=prompt, max_new_tokens=20, eos_token_id=eos) == want


@pytest.mark.parametrize("eos, err, msg", [
    ("x", DTypeError, r"eos_token_id: expected a token id .*'x' \(str\)"),
    (2.5, DTypeError, r"eos_token_id: expected a token id .*2\.5 \(float\)"),
    (["x"], DTypeError, "eos_token_id: element 0 is 'x'"),
    ([1, 2.0], DTypeError, "eos_token_id: element 1 is 2.0"),
    (True, DTypeError, "eos_token_id: expected a token id .*True"),
    ({"eos": 1}, DTypeError, "eos_token_id: expected a token id"),
    (-1, TokenIdError, r"eos_token_id: \[-1\] are outside the vocabulary"),
    ([3, VOCAB + 5], TokenIdError, rf"eos_token_id: \[{VOCAB + 5}\] are outside"),
])
def test_bad_eos_token_id(model, prompt, eos, err, msg):
    with pytest.raises(err, match=msg):
        _gen(model, input_ids=prompt, eos_token_id=eos)


# --- chat prompts -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model():
    tok = trained_bpe()
    return bitmtp.load(tiny_model("llama", seed=7, vocab_size=300), adapter=None, tokenizer=tok, capacity=64)


def test_a_valid_chat_encodes_through_the_template(chat_model):
    chat = [{"role": "user", "content": "quick dog"}, {"role": "assistant", "content": "lazy fox"}]
    want = chat_model.tokenizer("<s>user: quick dog</s><s>assistant: lazy fox</s>")["input_ids"]
    assert chat_model.encode(chat) == want
    assert len(bitmtp.generate(chat_model, chat, max_new_tokens=4, policy="ar").token_ids) >= 1


@pytest.mark.parametrize("chat, msg", [
    ([], "prompt: the chat is empty"),
    (["hello"], "prompt: message 0 is 'hello' .*not a dict"),
    ([{"role": "user", "content": "a"}, ("user", "b")], "prompt: message 1 is .*not a dict"),
    ([{"role": "user"}], "prompt: message 0 has no 'content'"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "prompt: message 1 has no 'role'"),
    ([{"role": "user", "content": 5}], r"prompt: message 0's 'content' is 5 \(int\)"),
    ([{"role": "user", "content": "a"}, {"role": None, "content": "b"}], "prompt: message 1's 'role' is None"),
])
def test_bad_chat_messages(chat_model, chat, msg):
    with pytest.raises(BitMTPError, match=msg):
        bitmtp.generate(chat_model, chat, max_new_tokens=2, policy="ar")


@pytest.mark.parametrize("prompt", [5, b"bytes", {"role": "user", "content": "x"}])
def test_a_prompt_that_is_neither_text_nor_chat(chat_model, prompt):
    with pytest.raises(DTypeError, match="prompt: expected text or a list of chat messages"):
        bitmtp.generate(chat_model, prompt, max_new_tokens=2, policy="ar")


# --- device, capacity, m_max --------------------------------------------------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    """Every loader fails loudly: an error must come before the model is read."""
    import bitmtp.api as api
    import bitmtp.model.gguf_io as gguf_io

    def boom(*a, **k):
        raise AssertionError("the loader ran before the argument was checked")

    for mod, name in ((api, "from_transformers"), (api, "from_safetensors_dir"), (gguf_io, "read_model")):
        monkeypatch.setattr(mod, name, boom)


@pytest.mark.parametrize("device, mocked, msg", [
    ("cuda", (False, 0), "device: 'cuda' was requested but CUDA is not available here.*device='cpu'"),
    ("cuda:3", (True, 1), r"device: 'cuda:3' does not exist; this machine has 1 CUDA device"),
    ("mps", None, "device: bitmtp runs on 'cpu' or 'cuda', got 'mps'"),
    ("gpu please", None, "device: 'gpu please' is not a device"),
])
def test_bad_device(monkeypatch, no_loading, device, mocked, msg):
    if mocked is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: mocked[0])
        monkeypatch.setattr(torch.cuda, "device_count", lambda: mocked[1])
    with pytest.raises(DeviceError, match=msg):
        bitmtp.load(tiny_model("llama", seed=1), device=device, adapter=None)


@pytest.mark.parametrize("backend", ["foo", "CPU", 3])
def test_unknown_backend_is_refused_before_loading(no_loading, backend):
    with pytest.raises(BitMTPError, match=r"backend: expected one of \[.*'torch'.*'wgpu'\].*got"):
        bitmtp.load(tiny_model("llama", seed=1), adapter=None, backend=backend)


@pytest.mark.parametrize("name, value", [("capacity", 0), ("capacity", -5), ("capacity", 2.5), ("capacity", "8"),
                                         ("capacity", True), ("capacity", None), ("m_max", 0), ("m_max", "x")])
def test_capacity_and_m_max_must_be_positive_ints(no_loading, name, value):
    with pytest.raises(BitMTPError, match=f"{name}: must be an integer >= 1, got"):
        bitmtp.load(tiny_model("llama", seed=1), adapter=None, **{name: value})


def _row_bytes(hf) -> int:
    """KV (K and V, float32, every layer) plus the float32 RoPE cos/sin rows, from the HF config."""
    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4 + 2 * head_dim * 4


@pytest.mark.parametrize("kind", ["live", "folder", "gguf"])
def test_a_huge_capacity_is_refused_before_loading(tmp_path, monkeypatch, kind):
    hf = tiny_model("llama", seed=1)
    source = hf
    if kind == "folder":
        hf.save_pretrained(tmp_path / "ckpt")
        source = tmp_path / "ckpt"
    elif kind == "gguf":
        source = bitmtp.load(hf, adapter=None, capacity=16).save_gguf(tmp_path / "m.gguf", progress=False)
    import bitmtp.api as api
    import bitmtp.model.gguf_io as gguf_io

    def boom(*a, **k):
        raise AssertionError("the loader ran: the RoPE tables of 10**9 rows were about to be built")

    for mod, name in ((api, "from_transformers"), (api, "from_safetensors_dir"), (gguf_io, "read_model")):
        monkeypatch.setattr(mod, name, boom)
    avail = 6 * 2**30
    monkeypatch.setattr(api, "_available_bytes", lambda device: avail)
    need = (10**9 + 31) * _row_bytes(hf)
    with pytest.raises(BitMTPError, match=r"capacity: 1000000000 tokens need .* GiB .*only 6\.00 GiB") as info:
        bitmtp.load(source, capacity=10**9, adapter=None)
    assert f"{need / 2**30:.2f} GiB" in str(info.value)
    # the suggestion is bounded by the model's context length and says generation stops at capacity
    assert "capacity=512 or less fits" in str(info.value) and "stops at capacity" in str(info.value)


def test_the_suggested_capacity_fits_and_loads(monkeypatch):
    import bitmtp.api as api

    hf = tiny_model("llama", seed=1, max_position_embeddings=10**6)
    row = _row_bytes(hf)
    avail = 3000 * row + 12345  # room for ~2400 rows after the 80 % margin
    monkeypatch.setattr(api, "_available_bytes", lambda device: avail)
    with pytest.raises(BitMTPError, match="capacity: 100000 tokens") as info:
        bitmtp.load(hf, capacity=100_000, adapter=None)
    fits = int(re.search(r"capacity=(\d+) or less fits", str(info.value)).group(1))
    assert (fits + 31) * row <= avail and fits == int(avail * 0.8) // row - 31
    m = bitmtp.load(hf, capacity=fits, adapter=None)
    assert m.engine.capacity == fits and m.engine.kv.nbytes == 2 * 2 * 2 * 16 * 4 * (fits + 31)
    monkeypatch.setattr(api, "_available_bytes", lambda device: row * 10)
    with pytest.raises(BitMTPError, match="capacity: 64 tokens .*no capacity fits"):
        bitmtp.load(hf, capacity=64, adapter=None)


def test_available_memory_is_read(tmp_path):
    from bitmtp.api import _available_bytes

    got = _available_bytes(torch.device("cpu"))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert got is not None and 0 < got <= total


@pytest.mark.parametrize("error, wrapped", [
    ("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried to allocate 9 bytes", True),
    ("CUDA out of memory. Tried to allocate 20.00 GiB", True),
    ("some other runtime failure", False),
])
def test_an_allocator_failure_names_capacity(monkeypatch, error, wrapped):
    import bitmtp.api as api

    def engine(*a, **k):
        raise RuntimeError(error)

    monkeypatch.setattr(api, "Engine", engine)
    hf = tiny_model("llama", seed=1)
    if not wrapped:
        with pytest.raises(RuntimeError, match="some other runtime failure"):
            bitmtp.load(hf, capacity=200, adapter=None)
        return
    need = (200 + 31) * _row_bytes(hf)
    with pytest.raises(BitMTPError, match=rf"capacity: allocating the KV store for 200 tokens \({need} bytes"):
        bitmtp.load(hf, capacity=200, adapter=None)


@pytest.mark.parametrize("prompt_len, new, want", [
    (70, 10**9, r"capacity=512\) \(at most its context length, 512; generation stops at capacity anyway"),
    (70, 20, r"capacity=90\)"),
    (600, 5, "and the model's context length of 512 tokens; shorten the prompt to under 512"),
])
def test_the_capacity_advice_is_sensible(model, rng, prompt_len, new, want):
    ids = torch.randint(3, VOCAB, (prompt_len,), generator=rng).tolist()
    with pytest.raises(BitMTPError, match="input_ids: prompt of .* exceeds the KV store's capacity of 64") as info:
        bitmtp.generate(model, input_ids=ids, max_new_tokens=new, policy="ar")
    assert re.search(want, str(info.value)) and "1000000" not in str(info.value)


# --- min_prefix --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_model():
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=128, quantize="ternary",
                    adapter=None)
    m.load_adapter(random_adapter(m.args, "mask-block", block_size=8, seed=7))
    return m


@pytest.mark.parametrize("block", [3, 6])
def test_min_prefix_ends_equal_speculative_and_confidence(mtp_model, rng, block):
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (int(torch.randint(2, 25, (1,), generator=rng)),), generator=rng).tolist()
        kw = dict(input_ids=ids, max_new_tokens=30, block_size=block, tau=TAU, eos_token_id=[])
        spec = bitmtp.generate(mtp_model, policy="speculative", **kw)
        conf = bitmtp.generate(mtp_model, policy="confidence", **kw)
        for m in (block + 1, block + 9):
            hyb = bitmtp.generate(mtp_model, policy="hybrid", min_prefix=m, **kw)
            assert hyb.token_ids == spec.token_ids and hyb.stats.committed == spec.stats.committed
            assert hyb.stats.verifier_rate == 1.0
        for m in (0, 1):
            hyb = bitmtp.generate(mtp_model, policy="hybrid", min_prefix=m, **kw)
            assert hyb.token_ids == conf.token_ids and hyb.stats.committed == conf.stats.committed
            assert hyb.stats.verifier_calls == 0


@pytest.mark.parametrize("m", [-1, "2", 2.0, True])
def test_bad_min_prefix(mtp_model, m):
    with pytest.raises(BitMTPError, match=r"min_prefix: m must be an integer >= 0"):
        bitmtp.generate(mtp_model, input_ids=[5, 6, 7], max_new_tokens=4, policy="hybrid", min_prefix=m)


# --- code a file carries never runs -----------------------------------------------------------------------

class _Stub:
    """A tokenizer stand-in whose saved files the test chooses."""

    chat_template = None


def _evil_files(marker) -> dict:
    code = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from transformers import PreTrainedTokenizerFast\n"
            "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = {"auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]}, "tokenizer_class": "EvilTokenizer"}
    return {"tokenizer_config.json": {"text": json.dumps(config)}, "evil.py": {"text": code}}


@pytest.fixture
def no_prompt(monkeypatch):
    """stdin closed and input() failing: a "run custom code? [y/N]" prompt would show as an error."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))

    def no_input(*a, **k):
        raise AssertionError("an interactive prompt was shown")

    monkeypatch.setattr(builtins, "input", no_input)


@pytest.mark.parametrize("case", ["auto_map and evil.py", "auto_map alone", "path escape", "subfolder",
                                  "bad base64", "not a mapping"])
def test_a_gguf_tokenizer_cannot_run_code(tmp_path, monkeypatch, no_prompt, case):
    import bitmtp.model.gguf_io as gguf_io

    marker = tmp_path / "marker"
    files = _evil_files(marker)
    want = r"'evil\.py' is not a tokenizer data file"
    if case == "auto_map alone":
        del files["evil.py"]
        want = r"tokenizer_config\.json names custom tokenizer code \(auto_map"
    elif case == "path escape":
        files = {"../tokenizer.json": {"text": "{}"}}
        want = r"'\.\./tokenizer\.json' is not a tokenizer data file"
    elif case == "subfolder":
        files = {"sub/tokenizer.json": {"text": "{}"}}
        want = r"'sub/tokenizer\.json' is not a tokenizer data file"
    elif case == "bad base64":
        files = {"tokenizer.model": {"base64": "@@not base64@@"}}
        want = r"'tokenizer\.model' is not valid base64"
    elif case == "not a mapping":
        files = {"tokenizer.json": ["x"]}
        want = r"the entry of 'tokenizer\.json' must be"
    monkeypatch.setattr(gguf_io, "tokenizer_files", lambda tok: files)
    base = bitmtp.load(tiny_model("llama", seed=2), adapter=None, capacity=16)
    base.tokenizer = _Stub()
    path = base.save_gguf(tmp_path / "evil.gguf", progress=False)
    with pytest.raises(FormatError, match=want) as info:
        bitmtp.load(path, adapter=None, capacity=16)
    assert "bitmtp.tokenizer.files" in str(info.value) and str(path) in str(info.value)
    assert not marker.exists()  # the .py never ran


def test_a_checkpoint_folder_tokenizer_cannot_run_code(tmp_path, no_prompt):
    """A checkpoint folder whose tokenizer_config.json asks for custom code: transformers is called with
    trust_remote_code=False, so the code does not run and load() reports a FormatError."""
    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    tiny_model("llama", seed=2).save_pretrained(folder)
    for name, entry in _evil_files(marker).items():
        (folder / name).write_text(entry["text"])
    with pytest.raises(FormatError, match=r"ckpt: the tokenizer files cannot be loaded .*never runs"):
        bitmtp.load(folder, adapter=None, capacity=16)
    assert not marker.exists()


def test_a_bitmtp_gguf_tokenizer_still_round_trips(tmp_path, chat_model):
    """The data-file allow-list keeps what save_pretrained writes for a real tokenizer."""
    path = chat_model.save_gguf(tmp_path / "tok.gguf", progress=False)
    back = bitmtp.load(path, adapter=None, capacity=16)
    text = "the lazy fox"
    assert back.encode(text) == chat_model.encode(text)
    chat = [{"role": "user", "content": "quick dog"}]
    assert back.encode(chat) == chat_model.encode(chat)


# --- raw exceptions and misleading messages (issue 42, item 6) -----------------------------------------------

@pytest.mark.parametrize("adapter, msg", [
    (5, r"adapter: expected an adapter folder \(str or Path\), a \(config, tensors\) pair .* got 5 \(int\)"),
    (("x", "y"), r"adapter: the pair's first item must be an AdapterConfig, got 'x' \(str\)"),
    ((1, 2, 3), r"adapter: expected an adapter folder .* got \(1, 2, 3\) \(tuple\)"),
])
def test_load_adapter_refuses_what_is_not_an_adapter(model, adapter, msg):
    with pytest.raises(BitMTPError, match=msg):
        model.load_adapter(adapter)
    assert model.drafter is None and model.adapter_config is None  # nothing half-attached


def test_load_adapter_pair_needs_tensors(mtp_model):
    config = mtp_model.adapter_config
    with pytest.raises(BitMTPError, match=r"adapter: the pair's second item must be a dict of name -> torch.Tensor"):
        mtp_model.session().load_adapter((config, ["not", "tensors"]))


@pytest.mark.parametrize("policy", ["auto", "ar", "speculative"])
def test_a_drafter_that_is_not_one_is_named(model, prompt, policy):
    with pytest.raises(BitMTPError, match=r"drafter: expected one of 'adapter', 'lookup', 'lookup\+adapter', a "
                                          r"bitmtp.decoding.drafters.Drafter, or None .*got 123 \(int\)"):
        bitmtp.generate(model, input_ids=prompt, drafter=123, policy=policy, max_new_tokens=2)


@pytest.mark.parametrize("value", ["5", 2.0, None, True, 0])
def test_generate_ar_checks_max_new_tokens(model, prompt, value):
    with pytest.raises(BitMTPError, match=r"max_new_tokens: must be an integer >= 1, got .*max_new_tokens=128"):
        model.generate_ar(prompt, max_new_tokens=value)
    assert model.generate_ar(prompt, max_new_tokens=3, eos_token_id=[]).tokens  # a good call still decodes


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_save_gguf_to_an_unwritable_folder_is_named_before_encoding(model, monkeypatch):
    import bitmtp.model.gguf_io as gguf_io

    def boom(*a, **k):
        raise AssertionError("tensors were encoded before the destination was checked")

    monkeypatch.setattr(gguf_io, "decoder_state", boom)
    with pytest.raises(BitMTPError, match=r"/proc/x.gguf: cannot create a file in /proc .*folder you can write to"):
        model.save_gguf("/proc/x.gguf", progress=False)
    with pytest.raises(BitMTPError, match="path: expected a file path"):
        model.save_gguf(5, progress=False)


def test_session_of_a_vulkan_model_names_the_runtime(model):
    import dataclasses

    with pytest.raises(BitMTPError, match="session: a runtime='vulkan' model keeps one KV store") as info:
        dataclasses.replace(model, plan=object()).session()
    assert "wgpu" not in str(info.value)


@pytest.mark.parametrize("dtype, msg", [
    (torch.int8, r"dtype: the dense compute dtype must be one of torch.float32, torch.float16, torch.bfloat16 .*"
                 r"got torch.int8"),
    ("float16", r"dtype: .*got 'float16' \(str\); write torch.float16"),
    (torch.float64, "dtype: .*got torch.float64"),
])
def test_load_names_dtype_not_kv_dtype(no_loading, dtype, msg):
    with pytest.raises(DTypeError, match=msg) as info:
        bitmtp.load(tiny_model("llama", seed=1), adapter=None, dtype=dtype)
    assert "kv_dtype" not in str(info.value)


def test_capacity_advice_spells_options_for_its_reader(model, monkeypatch):
    """Python callers read ``bitmtp.load(..., capacity=N)``; inside ``command_line_advice`` (what ``bitmtp.cli.main``
    runs each command in) the same errors read ``--capacity N``, and the setting ends with the block."""
    import bitmtp.api as api

    ids = list(range(3, 80))
    with api.command_line_advice():
        with pytest.raises(BitMTPError) as cli:
            bitmtp.generate(model, input_ids=ids, max_new_tokens=4, policy="ar")
        monkeypatch.setattr(api, "_available_bytes", lambda device: 3000 * _row_bytes(tiny_model("llama", seed=1)))
        with pytest.raises(BitMTPError) as cli_load:
            bitmtp.load(tiny_model("llama", seed=1), capacity=100_000, adapter=None)
    assert str(cli.value).startswith("--capacity: the prompt of 77 tokens exceeds the KV store's capacity of 64")
    assert "run with --capacity 81 " in str(cli.value) and "bitmtp.load" not in str(cli.value)
    assert str(cli_load.value).startswith("--capacity: 100000 tokens need")
    assert re.search(r"--capacity \d+ or less fits", str(cli_load.value))
    with pytest.raises(BitMTPError, match=r"input_ids: prompt of 77 .*bitmtp.load\(\.\.\., capacity=81\)"):
        bitmtp.generate(model, input_ids=ids, max_new_tokens=4, policy="ar")

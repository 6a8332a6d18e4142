"""Scale-out on Ray Serve: two replicas of the same app on a local Ray cluster answer one client, and
both replicas' ids are seen (slow: a Ray cluster starts and each replica loads the model)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

import bitmtp
from tests.support.smollm2 import PROMPTS, smollm2_path

NEW = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ray_serve_replicas_answer_one_client(smollm2):
    ray = pytest.importorskip("ray", reason="pip install 'bitmtp[ray]'")
    openai = pytest.importorskip("openai")
    from ray import serve

    from bitmtp.serve import ray_app

    ref = {p: bitmtp.generate(smollm2, [{"role": "user", "content": p}], batcher=False, max_new_tokens=NEW).text
           for p in PROMPTS[:4]}
    port = _free_port()
    # logical CPUs for the two replicas (1 each) whatever the machine has; a private namespace and no dashboard
    ray.init(num_cpus=4, include_dashboard=False, namespace="bitmtp-test", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_app(smollm2_path(), replicas=2, model_name="smollm2", load_kwargs={"capacity": 512}),
                  name="bitmtp-test", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"] == "smollm2"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        seen: set[str] = set()
        errors: list[BaseException] = []

        def ask(prompt: str) -> None:
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=NEW, temperature=0)
                resp = raw.parse()
                assert resp.choices[0].message.content == ref[prompt]
                assert raw.headers["x-bitmtp-replica"] == resp.model_extra["bitmtp"]["replica"]
                seen.add(raw.headers["x-bitmtp-replica"])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        for _ in range(6):  # rounds of concurrent requests until Ray has routed to both replicas
            threads = [threading.Thread(target=ask, args=(p,)) for p in ref]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"only replica(s) {seen} answered"
    finally:
        serve.shutdown()
        ray.shutdown()

"""Backend registry: explicit, environment and automatic selection; overrides; lazy loading."""

from __future__ import annotations

import logging

import pytest
import torch

from bitmtp.ops import registry, w2a8_linear
from bitmtp.ops.backends.torch_backend import TorchBackend


def test_available_backends_lists_reasons():
    info = registry.available_backends("cpu")
    assert info["torch"][0] is True
    for name, (ok, why) in info.items():
        assert isinstance(ok, bool) and why, name


def test_explicit_and_env_selection(monkeypatch):
    impl = registry.select("act_quant", torch.device("cpu"), "torch")
    assert impl.__self__.name == "torch"
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    assert registry.select("w2a8_linear_q", torch.device("cpu")).__self__.name == "torch"


def test_missing_op_falls_back_to_reference():
    class Partial:
        name = "partial"

        def availability(self, device):
            return True, "test backend"

    registry.register_backend("partial", Partial)
    try:
        impl = registry.select("act_quant", torch.device("cpu"), "partial")
        assert impl.__self__.name == "torch"
    finally:
        registry._LOADERS.pop("partial")
        registry._BACKENDS.pop("partial", None)


def test_broken_backend_reports_load_error():
    def boom():
        raise ImportError("no module named fancy_kernels")

    registry.register_backend("broken", boom)
    try:
        ok, why = registry.availability("broken", "cpu")
        assert not ok and "fancy_kernels" in why
    finally:
        registry._LOADERS.pop("broken")
        registry._LOAD_ERRORS.pop("broken", None)


def test_auto_fallback_logs_once(caplog, monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)

    class Unavailable:
        name = "cpu"

        def availability(self, device):
            return False, "extension not built"

    old_loader = registry._LOADERS.get("cpu")
    registry.register_backend("cpu", Unavailable)
    registry._LOGGED.clear()
    try:
        with caplog.at_level(logging.INFO, logger="bitmtp"):
            for _ in range(3):
                assert registry.select("w2a8_linear_q", torch.device("cpu")).__self__.name == "torch"
        lines = [r for r in caplog.records if "extension not built" in r.getMessage()]
        assert len(lines) == 1
    finally:
        if old_loader is None:
            registry._LOADERS.pop("cpu")
            registry._BACKENDS.pop("cpu", None)
        else:
            registry.register_backend("cpu", old_loader)


def test_override_injects_and_restores(rng):
    calls = []
    real = TorchBackend().w2a8_linear_q

    def slowed(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    from bitmtp.formats import pack_t2

    w = pack_t2(torch.randint(-1, 2, (8, 32), generator=rng))
    x = torch.randn(2, 32, generator=rng)
    with registry.override("torch", "w2a8_linear_q", slowed):
        w2a8_linear(x, w, torch.ones(1, 1), backend="torch")
    w2a8_linear(x, w, torch.ones(1, 1), backend="torch")
    assert calls == [1]


@pytest.mark.parametrize("device,first", [("cpu", "cpu"), ("cuda", "cuda")])
def test_preference_order(device, first):
    assert registry.PREFERENCE[device][0] == first
    assert registry.PREFERENCE[device][-1] == "torch"

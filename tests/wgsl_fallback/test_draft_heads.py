"""The Vulkan runtime's draft-heads step (``bitmtp.runtime.vulkan.device.DeviceModel.heads_step``: dense.wgsl,
elementwise.wgsl and norm.wgsl with W_down split into its state and embedding halves) against the one
Python heads step, ``bitmtp.model.adapters.DraftHeads.step``, within 1e-5 relative (fp32 shaders).

Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.wgsl import close

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("family,rows", [("llama", 1), ("qwen3", 3), ("bitnet", 5)])
def test_device_heads_step_equals_draft_heads_step(wg, rng, family, rows):
    """Every head k of a random heads adapter (non-zero up projections), on random states and token
    embeddings: the device step equals ``DraftHeads.step``; so does a chain of all heads fed back."""
    import bitmtp
    from bitmtp.formats.adapters import AdapterConfig, BaseShape
    from bitmtp.model.adapters import build_adapter, init_adapter_tensors
    from tests.support.hf_models import tiny_model

    r, ops = wg
    model = bitmtp.load(tiny_model(family, seed=int(torch.randint(0, 100, (1,), generator=rng))), adapter=None,
                        runtime="vulkan")
    cfg = AdapterConfig(kind="heads", block_size=5, rank=8, base=BaseShape.of(model.args))
    tensors = init_adapter_tensors(cfg, seed=int(torch.randint(0, 1000, (1,), generator=rng)), zero_init_b=False,
                                   b_std=0.3)
    heads = build_adapter(cfg, tensors, model.args)
    device = model.engine.pool.model
    device.set_heads(heads)
    h = model.args.hidden_size
    state = torch.randn(rows, h, generator=rng) * 2
    chain, dev_chain = state, r.upload(state.numpy())
    for k in range(heads.down.shape[0]):
        emb = torch.randn(rows, h, generator=rng)
        want = heads.step(k, state, emb)
        got = device.heads_step(k, r.upload(state.numpy()), r.upload(emb.numpy())).numpy()
        assert not torch.allclose(want, state)  # the head changes the state (B is not zero)
        close(got, want.double().numpy())
        chain = heads.step(k, chain, emb)
        dev_chain = device.heads_step(k, dev_chain, r.upload(emb.numpy()))
    close(dev_chain.numpy(), chain.double().numpy(), rel=1e-4)

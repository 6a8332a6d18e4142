"""step.wgsl: the decode loop's device-side verify preparation and resolution (greedy acceptance).

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.wgpu


def test_verify_prepare_and_resolve_on_device(wg):
    """The device versions of runtime/verify_prep.py against the torch ones."""
    from bitmtp.runtime.states import ReplayState
    from bitmtp.runtime.verify_prep import prepare_verify, resolve_verify

    r, ops = wg

    class R:  # a torch runner's tensors
        def __init__(self, w, role="verify", block=0):
            self.tokens, self.positions = torch.zeros(w, dtype=torch.long), torch.zeros(w, dtype=torch.long)
            self.out_token = torch.zeros(w, dtype=torch.long)
            self.state = ReplayState(w, 64, role, block)

    d, p = 4, 2
    draft, verify, nxt = R(p + d - 1, "draft", d), R(d), R(d, "draft", d)
    draft.positions[:] = torch.arange(20, 20 + p + d - 1)
    draft.out_token[:] = torch.tensor([0, 5, 6, 7, 8])
    arange = torch.arange(32)
    prepare_verify(draft, verify, arange)
    u = lambda t: r.upload(t.numpy().astype(np.uint32))  # noqa: E731
    out = u(torch.cat([draft.out_token, torch.zeros(p + d - 1, dtype=torch.long)]))
    vt, vp = r.empty((d,), "u32"), r.empty((d,), "u32")
    ops.prepare_verify(out, u(draft.positions), p, d, vt, vp)
    assert np.array_equal(vt.numpy(), verify.tokens.numpy()) and np.array_equal(vp.numpy(), verify.positions.numpy())
    for accepted in ([6, 7, 8, 9], [6, 1, 8, 9], [2, 7, 8, 9]):
        verify.out_token[:] = torch.tensor(accepted)
        resolve_verify(verify, nxt, arange)
        nt, np_ = r.empty((d,), "u32"), r.empty((d,), "u32")
        vout = u(torch.cat([verify.out_token, torch.zeros(d, dtype=torch.long)]))
        ops.resolve_verify(vout, u(verify.positions), u(verify.tokens), nt, np_)
        assert nt.numpy()[0] == nxt.tokens[0] and np.array_equal(np_.numpy(), nxt.positions.numpy())


@pytest.mark.parametrize("case", range(40))
def test_resolve_equals_the_python_acceptance_rule(wg, rng, case):
    """step.wgsl ``resolve`` on random drafts and verifier outputs (tokens from a 3-symbol alphabet, so
    every acceptance length occurs): the next draft step starts from v_a at (position of d_1) + a, with
    ``a`` from ``bitmtp.decoding.accept.speculative_accept`` (the host's rule), and its rows past the
    first token are left alone."""
    from bitmtp.decoding.accept import speculative_accept

    r, ops = wg
    d = int(torch.randint(2, 17, (1,), generator=rng))
    w = int(torch.randint(1, 17, (1,), generator=rng))
    pos0 = int(torch.randint(0, 4000, (1,), generator=rng))
    draft = torch.randint(0, 3, (d,), generator=rng)
    verify = torch.randint(0, 3, (d,), generator=rng)
    if case % 4 == 0:  # a fully accepted draft now and then (a = D)
        verify[:-1] = draft[1:]
    a = speculative_accept(draft.tolist(), verify.tolist())
    u32 = lambda t: r.upload(np.asarray(t, np.uint32))  # noqa: E731
    probs = torch.rand(d, generator=rng).numpy().view(np.uint32)  # the argmax output: ids, then probabilities
    out = u32(np.concatenate([verify.numpy().astype(np.uint32), probs]))
    poison = 0xDEADBEEF
    tok, pos = u32(np.full(w, poison)), u32(np.full(w, poison))
    ops.resolve_verify(out, u32(np.arange(pos0, pos0 + d)), u32(draft.numpy()), tok, pos)
    got_tok, got_pos = tok.numpy(), pos.numpy()
    assert int(got_tok[0]) == int(verify[a - 1]), (draft.tolist(), verify.tolist(), a)
    assert np.all(got_tok[1:] == poison)
    assert got_pos.tolist() == list(range(pos0 + a, pos0 + a + w))


@pytest.mark.parametrize("case", range(10))
def test_prepare_takes_the_drafts_last_d_tokens(wg, rng, case):
    """step.wgsl ``prepare``: verify tokens = the draft step's last D output ids, positions = the last
    pending row's position + 1 + [0, D), for random pending lengths p and blocks D."""
    r, ops = wg
    d = int(torch.randint(2, 17, (1,), generator=rng))
    p = int(torch.randint(1, d + 1, (1,), generator=rng))
    width = p + d - 1
    ids = torch.randint(0, 50000, (width,), generator=rng).numpy().astype(np.uint32)
    start = int(torch.randint(0, 4000, (1,), generator=rng))
    out = r.upload(np.concatenate([ids, np.zeros(width, np.uint32)]))
    tok, pos = r.empty((d,), "u32"), r.empty((d,), "u32")
    ops.prepare_verify(out, r.upload(np.arange(start, start + width, dtype=np.uint32)), p, d, tok, pos)
    assert tok.numpy().tolist() == ids[-d:].tolist()
    assert pos.numpy().tolist() == list(range(start + p, start + p + d))

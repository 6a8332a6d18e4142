"""The CPU steps' host inputs by numpy (``runtime.batch_pass.HostInputs``, ``runtime.graphs.HostCausal``).

Rule: equal, element for element, to the torch expressions they replace — the batch mask (row i sees KV rows
[base_i, end_i]), the causal mask (row i sees rows j <= position_i), the RoPE rows ``rope_cos[positions]`` /
``rope_sin[positions]`` — on awkward shapes, over buffers a previous step of another shape and other values
wrote (reused buffers must not leak a stale element), and views that track the buffers they are made over.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from bitmtp.errors import BitMTPError
from bitmtp.runtime.batch_pass import HostInputs
from bitmtp.runtime.graphs import HostCausal, causal_mask
from bitmtp.runtime.states import ReplayState

HEAD_DIM = 24


def _tables(n: int = 700) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, HEAD_DIM, generator=g), torch.randn(n, HEAD_DIM, generator=g)


@pytest.mark.parametrize("m", [1, 3, 8, 15, 16])
@pytest.mark.parametrize("seg", [256, 300, 641])
def test_batch_host_inputs_equal_the_torch_expressions(m, seg):
    cos, sin = _tables()
    host = HostInputs(1000, HEAD_DIM)
    rng = random.Random(m * 1000 + seg)
    for _ in range(3):  # the same shape again and after others: the reused buffers hold the last step's values
        for shape_m in (m, rng.randrange(1, 20), m):
            bases = [rng.randrange(0, seg) for _ in range(shape_m)]
            ends = [rng.randrange(b, seg) for b in bases]
            positions = [rng.randrange(0, 600) for _ in range(shape_m)]
            tokens = [rng.randrange(0, 50000) for _ in range(shape_m)]
            slots = [rng.randrange(0, seg) for _ in range(shape_m)]
            tok, pos, slot, mask, (c, s) = host.fill([tokens, positions, slots, bases, ends], seg,
                                                     (cos.numpy(), sin.numpy()))
            kv = torch.arange(seg)[None, :]
            b, e = torch.tensor(bases)[:, None], torch.tensor(ends)[:, None]
            assert tok.tolist() == tokens and pos.tolist() == positions and slot.tolist() == slots
            assert tok.dtype == pos.dtype == slot.dtype == torch.long and mask.dtype == torch.bool
            assert torch.equal(mask, (kv >= b) & (kv <= e)) and mask.is_contiguous()
            p = torch.tensor(positions)
            assert torch.equal(c, cos[p]) and torch.equal(s, sin[p]) and c.is_contiguous() and s.is_contiguous()


@pytest.mark.parametrize("m", [1, 3, 8, 15, 16])
def test_runner_host_causal_mask_and_rope_equal_the_torch_ones(m):
    cos, sin = _tables()
    seg = 513
    ints = np.full((2, m), -7, dtype=np.int64)  # poisoned: every element is written before it is read
    host = HostCausal(ints, seg, HEAD_DIM)
    host._mask[:] = True
    host._rope[:] = np.nan
    rng = random.Random(m)
    for _ in range(3):
        start = rng.randrange(0, seg - m)
        ints[1] = range(start, start + m)
        mask, (c, s) = host.inputs((cos.numpy(), sin.numpy()))
        positions = torch.from_numpy(ints[1])
        assert torch.equal(mask, causal_mask(ReplayState(m, seg, "ar"), positions, torch.arange(seg)))
        assert torch.equal(c, cos[positions]) and torch.equal(s, sin[positions])


def test_positions_past_the_rope_tables_are_named():
    cos, sin = _tables(50)
    host = HostInputs(300, HEAD_DIM)
    with pytest.raises(BitMTPError, match="position 60 is outside the RoPE tables' 50 rows"):
        host.fill([[1], [60], [60], [0], [60]], 256, (cos.numpy(), sin.numpy()))
    with pytest.raises(BitMTPError, match="segment: 301 KV rows, but the store holds 300"):
        host.fill([[1], [6], [6], [0], [6]], 301, (cos.numpy(), sin.numpy()))


@pytest.mark.parametrize("m", [1, 3, 8, 15, 16])
def test_a_batched_steps_inputs_are_the_same_by_numpy_and_by_torch(m):
    """``BatchPass.inputs``: the numpy path (CPU) and the torch path (other devices, here run on the CPU) give the
    same tokens, positions, slots and mask for rows of several sequences (bases on the 256-row grid, mask rows
    reaching past their position); the torch path leaves RoPE to the decoder."""
    import bitmtp
    from bitmtp.runtime.batch_pass import BatchPass
    from bitmtp.runtime.kv import KVStore
    from tests.support.hf_models import tiny_model

    model = bitmtp.load(tiny_model("bitnet", seed=3), capacity=300, quantize="ternary")
    a = model.decoder.args
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 4 * 256, 1)
    by_numpy, by_torch = BatchPass(model.decoder, kv), BatchPass(model.decoder, kv)
    by_torch.host = None
    rng = random.Random(m)
    for _ in range(3):
        bases = [256 * rng.randrange(0, 3) for _ in range(m)]
        positions = [rng.randrange(0, 200) for _ in range(m)]
        reach = [p + rng.randrange(0, 3) for p in positions]
        tokens = [rng.randrange(0, a.vocab_size) for _ in range(m)]
        one, two = by_numpy.inputs(tokens, positions, bases, reach), by_torch.inputs(tokens, positions, bases, reach)
        for x, y in zip(one[:4], two[:4], strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
        p = torch.tensor(positions)
        assert two[4] is None and torch.equal(one[4][0], model.decoder.rope_cos[p])

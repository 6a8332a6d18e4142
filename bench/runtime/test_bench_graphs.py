"""CUDA-graph replay against eager execution of one runtime step, per replay width M (NVIDIA GPU).

Two engines share one BitNet-2B-shaped decoder (random ternary weights; 8 layers in quick mode,
30 in full): one captures every step into a CUDA graph, the other (``eager=True``) launches the
same body op by op. For each width M (role ``ar`` at M = 1, ``verify`` above) the step is timed with
CUDA events over back-to-back runs, graph and eager alternating each round; ``graph_speedup`` =
eager time / replay time, median of the per-round ratios (gated, higher is better). On a CPU
there is nothing to compare — steps always run eagerly — so the file is skipped there.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from bench.conftest import HIGHER, by_mode, record
from bench.models import BITNET2B_LAYERS, bitnet2b_decoder
from bench.ratios import cuda_event_time
from bitmtp.runtime import Engine, ReplayState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)")

WIDTHS = by_mode((1, 4, 8, 16), (1, 2, 4, 8, 15, 16))
ROUNDS = by_mode(5, 9)
REPS = 20
PROMPT = list(range(100, 164))




@pytest.fixture(scope="module")
def engines():
    decoder = bitnet2b_decoder(by_mode(8, BITNET2B_LAYERS), device="cuda")
    graphed = Engine(decoder, capacity=512, m_max=16, eager=False)
    eager = Engine(decoder, capacity=512, m_max=16, eager=True)
    assert graphed.pool.capture and not eager.pool.capture
    return graphed, eager


def _runner(eng: Engine, m: int):
    eng.reset()
    eng.prefill(PROMPT)
    n = eng.n
    state = ReplayState(m, eng.kv.segment_for(n + m), "ar" if m == 1 else "verify")
    r = eng.pool.get(state)
    r.tokens.copy_(torch.randint(100, 1000, r.tokens.shape))
    torch.arange(n, n + m, out=r.positions)
    return r


@pytest.mark.parametrize("m", WIDTHS, ids=[f"M{m}" for m in WIDTHS])
def test_graph_replay_vs_eager(benchmark, engines, m):
    graphed, eager = engines
    g_run, e_run = _runner(graphed, m), _runner(eager, m)
    benchmark.pedantic(lambda: (g_run.run(), torch.cuda.synchronize()), rounds=5, iterations=1, warmup_rounds=2)
    if benchmark.disabled:
        e_run.run()
        return
    assert g_run.graph is not None, "the graphed engine did not capture its step"
    ratios, tg, te = [], [], []
    for _ in range(ROUNDS):  # alternate graph replay and eager launches
        t_graph = cuda_event_time(g_run.run, REPS, warm=True)
        t_eager = cuda_event_time(e_run.run, REPS, warm=True)
        ratios.append(t_eager / t_graph)
        tg.append(t_graph)
        te.append(t_eager)
    record(benchmark, shapes=f"BitNet-2B, {graphed.decoder.args.num_layers} layers, cuda", M=m,
           role=g_run.state.role, graph_us=statistics.median(tg) * 1e6, eager_us=statistics.median(te) * 1e6,
           graph_speedup=statistics.median(ratios), gates={"graph_speedup": HIGHER})

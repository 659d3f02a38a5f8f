"""GatheredRows.sums (fixed capacity's combine) in torch on the CPU sums
2 MiB of terms at a time (issue 37): the same bits as the whole call, and
each arrival's weighted sum of its valid slots (a per-arrival loop), with
padding rows full of NaN (where an empty slot looks) adding nothing."""

import numpy as np
import pytest

from commlib.moe.expand import GatheredRows

import requires

torch = requires.module("torch")


@pytest.mark.parametrize("weighted", [True, False])
def test_sliced_sums_are_the_whole_sums_and_the_loop(weighted):
    gen = torch.Generator().manual_seed(3)
    arrivals, k, hidden, rows_count = 40, 8, 4096, 200  # 40 x 8 x 4096 x 4 B: 5 MiB of terms
    rows = torch.randn(rows_count, hidden, generator=gen).to(torch.bfloat16)
    rows[:4] = float("nan")  # padding: the rows an empty slot's index falls back on
    slot_rows = torch.randint(4, rows_count, (arrivals * k,), generator=gen)
    slot_rows[torch.rand(arrivals * k, generator=gen) < 0.3] = rows_count  # no slot
    weights = torch.where(slot_rows < rows_count, torch.rand(arrivals * k, generator=gen), 0.0)
    gathered = GatheredRows(arrivals, slot_rows, weights, k)
    sliced = gathered.sums(rows, weighted)
    whole = gathered._sums(rows, weighted, 0, arrivals)
    expected = np.zeros((arrivals, hidden))
    for a in range(arrivals):
        for j in range(k):
            r = int(slot_rows[a * k + j])
            if r < rows_count:
                factor = float(weights[a * k + j]) if weighted else 1.0
                expected[a] += factor * rows[r].double().numpy()
    assert sliced.dtype == torch.float32 and torch.equal(sliced, whole)
    np.testing.assert_allclose(sliced.numpy(), expected, rtol=1e-5, atol=1e-5)

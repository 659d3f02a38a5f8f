"""The attention conformance matrix (tests/conformance.py) at this launch's
world size: each case equals torch SDPA in float64 on the unsharded
sequence with the case's dense mask, output and the three gradients (with
attention sinks: the eager softmax with the sink column, and the sinks'
gradient; with a cap: the eager softmax of the capped scores), or is
refused on every rank with the predicted error. Nothing is skipped."""

import numpy as np
import pytest
from mpi4py import MPI

import conformance
import covering
import requires
from attention_reference import position_mask, relative_error
from conftest import all_ranks, same_on_all_ranks

requires.module("torch")
requires.module("jax")

# odd sizes change every layout's cuts and the hybrid's degree; 4 makes the
# hybrid a real Ulysses x Ring grid; 1 is the degenerate world
WORLD_SIZES = (1, 2, 3, 4)
WORLD = MPI.COMM_WORLD.Get_size()
CASES = conformance.cases(WORLD)
INFERENCE_CASES = conformance.inference_cases(WORLD)


@pytest.mark.parametrize("case", CASES, ids=conformance.case_id)
def test_case_is_correct_or_refused_everywhere(comm, case):
    length = conformance.length_of(case, comm.size)
    options, dense = conformance.visibility(case, length)
    seed = len(conformance.case_id(case))
    full = conformance.inputs(case, length, seed=seed)
    sinks = conformance.sinks_of(case, seed)
    refusal = conformance.expected_refusal(case)
    try:
        got = conformance.run_case(case, comm, full, options, sinks)
    except (ValueError, TypeError) as error:
        raised = f"{type(error).__name__}: {error}"
        assert all_ranks(refusal is not None and refusal in raised), (
            f"refused, but the matrix says {'compute' if refusal is None else repr(refusal)}: "
            f"{raised}")
        return
    assert all_ranks(refusal is None), f"computed, but should have been refused ({refusal!r})"
    want = conformance.reference(full, dense, sinks, conformance.softcap_of(case))
    bounds = conformance.TOLERANCE[case["dtype"]]
    errors = [relative_error(g, w) for g, w in zip(got, want)]
    ok = len(got) == len(want) and errors[0] <= bounds[0] and max(errors[1:]) <= bounds[1]
    assert all_ranks(ok), f"errors (out, dq, dk, dv[, dsinks]) {errors} over bounds {bounds}"


@pytest.mark.parametrize("case", INFERENCE_CASES, ids=conformance.case_id)
def test_inference_case_is_sdpa_over_the_whole_cache(comm, case):
    """Decode and a chunk's prefill over the striped cache: each rank's
    queries get SDPA's output on the unsharded sequence (float64, the mask
    by position; with sinks, the eager softmax with the sink column), in
    the case's framework and dtype."""
    length = conformance.CACHED + conformance.NEW
    seed = len(conformance.case_id(case))
    full = conformance.inputs(case, length, seed=seed)
    sinks = conformance.sinks_of(case, seed)
    got, asked = conformance.run_inference_case(case, comm, full, sinks)
    mask = position_mask(asked, np.arange(length), **conformance.inference_visibility(case))
    q, k, v, _ = full
    no_gradient = np.zeros(q[:, asked].shape[:-1] + v.shape[-1:])
    want = conformance.reference([q[:, asked], k, v, no_gradient], mask,
                                 sinks, conformance.softcap_of(case))[0]
    error = relative_error(got, want)
    assert all_ranks(error <= conformance.TOLERANCE[case["dtype"]][0]), error


def test_every_rank_runs_the_same_cases():
    same_on_all_ranks([conformance.case_id(c) for c in CASES]
                      + [conformance.case_id(c) for c in INFERENCE_CASES])


def test_the_matrix_covers_every_pair_and_entry_layout_method():
    """The full tier meets every pair of option values and every (entry
    point, layout, method); the quick tier is a sample of it."""
    every = covering.covering(conformance.FACTORS, full=conformance.FULL, seed=WORLD)
    assert not covering.pairs_missed(every, conformance.FACTORS)
    triples = {(c["api"], c["algorithm"], c["layout"], c["method"]) for c in every}
    f = conformance.FACTORS
    assert len(triples) == (len(f["api"]) * len(f["algorithm"]) * len(f["layout"])
                            * len(f["method"]))
    assert all(case in every for case in CASES)
    assert len(np.unique([conformance.case_id(c) for c in CASES])) == len(CASES)

"""alltoallv count validation: messages that say what is wrong."""

import numpy as np
import pytest

from commlib.counts import as_counts, check_rows


def test_accepts_lists_and_integer_arrays():
    assert as_counts("c", [1, 2, 3], 3).tolist() == [1, 2, 3]
    assert as_counts("c", np.array([1, 2], np.uint8), 2).dtype == np.int64


@pytest.mark.parametrize("counts, message", [
    ([1, 2], "one entry per rank (3)"),
    ([[1, 2, 3]], "one entry per rank"),
    ([1, -2, 3], "non-negative"),
    ([1.0, 2.0, 3.0], "must be integers"),
    ([True, False, True], "must be integers"),
    ("abc", "sequence of 3 integers"),
    (object(), "sequence of 3 integers"),
    (np.array([2**63, 0, 0], np.uint64), "too large"),
])
def test_rejects(counts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        as_counts("send_counts", counts, 3)


def test_rows_must_be_covered():
    check_rows("send_counts", np.array([1, 2]), 3)
    with pytest.raises(ValueError, match="sums to 3 rows but x has 4"):
        check_rows("send_counts", np.array([1, 2]), 4)

"""What the torch.compile tests share (tests/mpi/test_compile.py, the ops;
tests/mpi/test_compile_models.py, transformers' blocks and models): a
backend that counts graphs, graph breaks explained, a step's loss and
gradients, and how two such results compare. Import ``fresh_dynamo`` into
a test module to have every test there compile from nothing."""

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from nothing: dynamo's cache of earlier tests'
    graphs would hide a compile (and its recompile limit a retrace)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A backend that counts the graphs dynamo hands it, then runs them
    through ``aot_eager`` (forward and backward graphs, eager's kernels)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return aot_eager(graph, example_inputs)


def breaks(function, *args, **kwargs):
    """``torch._dynamo.explain``'s graph break count and reasons."""
    explained = torch._dynamo.explain(function)(*args, **kwargs)
    torch._dynamo.reset()
    return explained.graph_break_count, [str(r.reason)[:300] for r in explained.break_reasons]


def run(step, inputs, *extra):
    """step's loss and the gradients of ``inputs`` (fresh leaves)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    loss = step(*leaves, *extra)
    loss.backward()
    return loss.detach(), [x.grad for x in leaves]


def identical(a, b):
    """Bitwise: the loss and every gradient."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return torch.equal(loss_a, loss_b) and all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))


def largest_error(a, b):
    """The largest error of the loss and of any gradient, relative to the
    largest magnitude of eager's (``b``) value."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return max(float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30)
               for x, y in zip([loss_a, *grads_a], [loss_b, *grads_b]))

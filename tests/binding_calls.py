"""An attention with sinks through the torch or the JAX binding, forward and
backward in float64, as NumPy: what the sinks and the soft-capping tests
compare against their eager references."""

import numpy as np

import requires


def through_binding(api, name, mine, sinks, comm, args, keywords):
    """(out, dq, dk, dv, dsinks) of ``{name}_attention`` in the ``api``
    binding (torch or jax), float64 NumPy."""
    if api == "torch":
        torch = requires.module("torch")
        from commlib.bindings import torch as ct
        q, k, v, dout = (torch.tensor(x, requires_grad=True) for x in mine)
        learned = torch.tensor(sinks, requires_grad=True)
        out = getattr(ct, f"{name}_attention")(q, k, v, comm, *args, sinks=learned, **keywords)
        out.backward(dout)
        return [x.detach().numpy() for x in (out, q.grad, k.grad, v.grad, learned.grad)]
    jax = requires.module("jax")
    from commlib.bindings import jax as cj
    attention = getattr(cj, f"{name}_attention")

    def step(q, k, v, dout, sinks):
        out, pullback = jax.vjp(lambda q, k, v, s: attention(q, k, v, comm, *args, sinks=s,
                                                             **keywords), q, k, v, sinks)
        return (out, *pullback(dout))
    with jax.enable_x64(True):
        got = jax.jit(step)(*(jax.numpy.asarray(x) for x in (*mine, sinks)))
        return [np.asarray(x) for x in got]

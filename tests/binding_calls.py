"""An attention with sinks through the torch or the JAX binding, forward and
backward in float64, as NumPy: what the sinks and the soft-capping tests
compare against their eager references; and a call of each entry point with
an option, for the tests that refuse bad values of it."""

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


def entry_call(entry, q, k, v, comm, **option):
    """A call of one attention entry point with ``option`` (``sinks=``,
    ``softcap=``) on [1, 4, h, d] shards: "ring", "allgather", "ulysses",
    "hybrid" (degree 1), "decode" and "chunk" (4 queries over 4 cached
    positions), "torch-ring" and "jax-ulysses" (under ``jax.jit``)."""
    from commlib import hybrid, ring, ulysses
    from commlib.inference import chunk_attention, decode_attention
    options = dict(layout="contiguous", causal=True, **option)
    positions = dict(q_positions=[8, 9, 10, 11], k_positions=[0, 1, 2, 3], causal=True, **option)
    if entry == "torch-ring":
        from commlib.bindings import torch as ct
        return lambda: ct.ring_attention(q, k, v, comm, **options)
    if entry == "jax-ulysses":
        jax = requires.module("jax")
        from commlib.bindings import jax as cj
        return lambda: jax.jit(lambda q, k, v: cj.ulysses_attention(
            q, k, v, comm, **options))(q, k, v)
    return {"ring": lambda: ring.ring_attention(q, k, v, comm, **options),
            "allgather": lambda: ring.ring_attention(q, k, v, comm, method="allgather",
                                                     **options),
            "ulysses": lambda: ulysses.ulysses_attention(q, k, v, comm, **options),
            "hybrid": lambda: hybrid.hybrid_attention(q, k, v, comm, 1, **options),
            "decode": lambda: decode_attention(q, k, v, comm, **positions),
            "chunk": lambda: chunk_attention(q, k, v, comm, **positions)}[entry]

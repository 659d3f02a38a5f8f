"""Framework bindings, one package each: ``commlib.bindings.torch``
(autograd functions and ``torch.library`` ops), ``commlib.bindings.jax``
(jit-able ``custom_vjp`` functions over a traced communicator) and
``commlib.bindings.transformers`` (Hugging Face models: attention, experts,
recurrent mixers, batches, generate) and ``commlib.bindings.diffusers``
(diffusion transformers context-parallel by their own ``_cp_plan``). Each
package's ``__all__`` is its API; its modules are private (``_``-prefixed).

Plain collectives already take and return any framework's arrays through
``commlib.dlpack``; these packages add differentiation (each backward runs
the mirror communication) and model integration. Import the one for your
framework (each imports it).
"""

"""Framework bindings (``commlib.bindings.torch``, ``commlib.bindings.jax``).

Plain collectives already take and return any framework's arrays through
``commlib.arrays``; the modules here will add what that cannot: autograd
functions for PyTorch and custom_vjp wrappers for JAX.
"""

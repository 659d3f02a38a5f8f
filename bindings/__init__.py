"""Framework bindings: ``commlib.bindings.torch`` (autograd functions) and
``commlib.bindings.jax`` (jit-able ``custom_vjp`` functions).

Plain collectives already take and return any framework's arrays through
``commlib.arrays``; these modules add differentiation: each backward runs the
mirror communication. Import the one for your framework (each imports it).
"""

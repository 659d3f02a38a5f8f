"""The ``commlib`` command line (``commlib.tools.cli``) and benchmarks."""

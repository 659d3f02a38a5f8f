"""``commlib diag``: one module a command (``alltoall``, ``moe``, ``attention``
for ring and ulysses), and what ``diag alltoall`` is made of (``sweep``,
``traffic``, ``table``, ``blame`` for --slow-links, ``plot``)."""

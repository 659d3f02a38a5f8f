"""Process-local names for the objects a call takes besides its arrays (a
communicator, a mask, a kernel).

A compiled graph can hold only tensors, numbers and strings: a
``torch.library`` custom op (``bindings.torch._attention_ops``) takes its communicator
and mask as these names and looks them up when it runs. Each name is made
when its object is, so that reading it is an attribute read, which
``torch.compile`` traces without a graph break, and is a constant the graph
is specialised on: the same communicator, or an equal mask, gives the same
name, and no retrace. The table holds its objects weakly: a name outlives
nothing.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Dict, List, Optional

# by identity (equal masks are distinct objects, each of which may be the last alive)
_objects: Dict[str, List["weakref.ref[Any]"]] = {}
_serial = itertools.count()


def name(kind: str, obj: Any, key: Optional[str] = None) -> str:
    """A name for ``obj``: ``kind:key`` where equal objects share ``key``
    (a mask's content), else ``kind:<serial>``, unique in this process."""
    handle = f"{kind}:{next(_serial) if key is None else key}"
    alive = [ref for ref in _objects.get(handle, ()) if ref() is not None]
    _objects[handle] = alive + [weakref.ref(obj)]
    return handle


def lookup(handle: str) -> Any:
    """The object named ``handle`` (any of the equal ones alive)."""
    for ref in _objects.get(handle, ()):
        obj = ref()
        if obj is not None:
            return obj
    _objects.pop(handle, None)
    kind = handle.partition(":")[0]
    raise LookupError(f"commlib: the {kind} named {handle!r} no longer exists (freed, or "
                      f"made in another process): a compiled graph that names it must be "
                      f"called with a live {kind}")

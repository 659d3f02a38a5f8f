"""Modules that moved, importable under the names earlier releases
documented as the very same module objects (never a second copy: a class
is one class, ``isinstance`` holds, and the names compiled graphs carry
stay the same)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Dict


def alias(package: ModuleType, moved: Dict[str, str]) -> None:
    """``package.<old>`` and ``import <package>.<old>`` give the module now
    at ``moved[old]``."""
    for old, new in moved.items():
        module = importlib.import_module(new)
        sys.modules[f"{package.__name__}.{old}"] = module
        setattr(package, old, module)

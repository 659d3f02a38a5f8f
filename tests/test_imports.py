"""Every module of commlib imports as the first import of a program.

A module that imports only after another one was imported (an import cycle
broken by luck of order) fails here: each runs in a fresh interpreter."""

import concurrent.futures
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import commlib
import commlib.bindings
import commlib.tools


def _modules():
    """commlib's modules, and those of the folders installed under it
    (bindings/ as commlib.bindings, tools/ as commlib.tools)."""
    found = {"commlib", "commlib.bindings", "commlib.tools"}
    for package in (commlib, commlib.bindings, commlib.tools):
        found |= {info.name for info in pkgutil.walk_packages(package.__path__,
                                                              package.__name__ + ".")}
    return sorted(found)


MODULES = _modules()
# the public API: docs/architecture.md's table lists each with its __all__
PUBLIC = ("commlib", "commlib.sequence", "commlib.sequence.masks", "commlib.sequence.common_masks",
          "commlib.sequence.balanced", "commlib.sequence.documents", "commlib.ring",
          "commlib.ring.sparse", "commlib.ulysses", "commlib.hybrid", "commlib.kernels",
          "commlib.moe", "commlib.moe.replicated", "commlib.inference", "commlib.recurrent",
          "commlib.bindings.torch", "commlib.bindings.jax", "commlib.bindings.transformers",
          "commlib.bindings.diffusers")
COMMAND = "commlib.tools.cli"  # the `commlib` command
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_public_modules_are_all_found():
    assert set(PUBLIC) | {COMMAND} <= set(MODULES), sorted(set(PUBLIC) - set(MODULES))


def _documented():
    """docs/architecture.md's table: module -> the names it lists."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("| module | its `__all__` |"):].split("\n\n")[0]
    rows = re.findall(r"^\| `([\w.]+)` \| (.*) \|$", table, re.MULTILINE)
    return {module: re.findall(r"`([\w]+)`", names) for module, names in rows}


def test_one_public_api_list():
    """The architecture page's table, this file's PUBLIC and each public
    module's __all__ (and docstring) say the same."""
    documented = _documented()
    assert tuple(documented) == PUBLIC
    for name in PUBLIC:
        module = importlib.import_module(name)
        assert module.__doc__, f"{name} has no docstring"
        assert list(module.__all__) == documented[name], name
        assert all(hasattr(module, attribute) for attribute in module.__all__), name


def test_the_bindings_docstring_names_every_binding_package():
    import commlib.bindings
    assert all(f"commlib.bindings.{name}" in commlib.bindings.__doc__
               for name in ("torch", "jax", "transformers", "diffusers"))


def test_import_commlib_loads_neither_the_geometry_nor_the_kernels():
    """``import commlib`` is the collectives: the attention packages load when asked for."""
    code = ("import sys, commlib; print(sorted(m for m in sys.modules if m.startswith("
            "('commlib.sequence', 'commlib.kernels', 'commlib.ring'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def _first_import(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                            text=True, timeout=300)
    return None if result.returncode == 0 else f"`import {module}`:\n{result.stderr}"


@pytest.mark.full  # 72 fresh interpreters: about two minutes on 2 cores
def test_every_module_imports_first():
    """Each module in its own fresh interpreter (several at once: 72
    interpreters, most of which import torch, take two minutes one by one)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        failures = [f for f in pool.map(_first_import, MODULES) if f]
    assert not failures, "\n".join(failures)


def test_the_file_map_matches_the_tree():
    """docs/architecture.md's file map: every path it names exists, and every
    module of commlib/, bindings/ and tools/ is named (a folder row names its files)."""
    root = ARCHITECTURE.parents[1]
    text = ARCHITECTURE.read_text()
    rows = re.findall(r"^\| `([\w/.]+)` \| (.*) \|$", text[text.index("## File map"):],
                      re.MULTILINE)
    named = set()
    for path, what in rows:
        assert (root / path).exists(), path
        named.add(path)
        if path.endswith("/"):
            named |= {path + name for name in re.findall(r"`([\w]+\.py)`", what)
                      if (root / path / name).exists()}
    for folder in ("commlib", "bindings", "tools"):
        for module in (root / folder).rglob("*.py"):
            relative = module.relative_to(root).as_posix()
            folder_row = relative.rsplit("/", 1)[0] + "/"
            assert relative in named or (relative.endswith("__init__.py")
                                         and folder_row in named), relative

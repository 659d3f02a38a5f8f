"""Every module of commlib imports as the first import of a program.

A module that imports only after another one was imported (an import cycle
broken by luck of order) fails here: each runs in a fresh interpreter."""

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


# a child forked from an interpreter that has loaded these (none of commlib) imports
# one module of commlib first: the third-party imports, most of the two minutes
# 72 fresh interpreters took, are paid once
PRELOAD = ("numpy", "click", "array_api_compat", "array_api_extra", "torch", "jax",
           "jax.numpy", "transformers", "diffusers")
_FIRST_IMPORTS = r"""
import importlib, os, sys, traceback
for name in {preload!r}:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] == "commlib"]
failed = []
for module in {modules!r}:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        told = pipe.read().decode()
    _, status = os.waitpid(child, 0)
    if status:
        failed.append("`import " + module + "`:\n" + told)
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.full  # 72 forked children of one interpreter: about a minute (three, fresh)
def test_every_module_imports_first():
    """Each module as the first of commlib's in a fresh process: a child
    forked from one interpreter that loaded the third-party libraries
    (``PRELOAD``) and nothing of commlib."""
    code = _FIRST_IMPORTS.format(preload=PRELOAD, modules=MODULES)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]

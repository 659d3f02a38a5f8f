"""Every module of commlib imports as the first import of a program.

A module that imports only after another one was imported (an import cycle
broken by luck of order) fails here: each runs in a fresh interpreter."""

import concurrent.futures
import pkgutil
import subprocess
import sys

import pytest

import commlib
import commlib.bindings
import commlib.tools


def _modules():
    """commlib's modules, and those of the folders installed under it
    (bindings/ as commlib.bindings, tools/ as commlib.tools)."""
    found = {"commlib.bindings", "commlib.tools"}
    for package in (commlib, commlib.bindings, commlib.tools):
        found |= {info.name for info in pkgutil.walk_packages(package.__path__,
                                                              package.__name__ + ".")}
    return sorted(found)


MODULES = _modules()
PUBLIC = ("commlib.ring", "commlib.ulysses", "commlib.hybrid", "commlib.moe", "commlib.kernels",
          "commlib.bindings.torch", "commlib.bindings.jax", "commlib.bindings.transformers",
          "commlib.tools.cli")


def test_the_public_modules_are_all_found():
    assert set(PUBLIC) <= set(MODULES), sorted(set(PUBLIC) - set(MODULES))


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

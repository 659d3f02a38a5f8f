"""The layer rule of docs/architecture.md, read from the source: each
package imports only the layers below it or its own layer (never a cycle
between packages), and no module imports another module's private
(``_``-prefixed) name; a package's own modules may import its private
modules (a binding's ``__init__`` over its ``_``-modules)."""

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the installed name of each folder (setup.py maps bindings/ and tools/ under commlib)
FOLDERS = {"commlib": "commlib", "bindings": "commlib.bindings", "tools": "commlib.tools"}

# lowest first; a module may import its own layer and the ones before it.
# Within a layer, packages may import one another, never both ways.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("foundation", ("commlib.errors", "commlib.namespace", "commlib.graph_names",
                    "commlib.dlpack", "commlib.fp8", "commlib.counts", "commlib.topology",
                    "commlib.progress", "commlib.watchdog", "commlib.abort",
                    "commlib.consistency", "commlib.launcher", "commlib.memory")),
    ("transport", ("commlib.backends",)),
    ("collectives", ("commlib.in_flight", "commlib.communicator", "commlib.bootstrap", "commlib")),
    ("kernels", ("commlib.kernels",)),
    ("geometry", ("commlib.sequence",)),
    ("algorithms", ("commlib.ring", "commlib.ulysses", "commlib.hybrid", "commlib.moe",
                    "commlib.inference", "commlib.recurrent")),
    ("bindings", ("commlib.bindings.torch", "commlib.bindings.jax")),
    ("models", ("commlib.bindings.transformers", "commlib.bindings.diffusers",
                "commlib.bindings")),
    ("tools", ("commlib.tools",)),
]


def _unit(module: str) -> str:
    """The package (or top-level module) of the layer table that holds ``module``."""
    names = [name for _, names in LAYERS for name in names]
    return max((name for name in names if module == name or module.startswith(name + ".")),
               key=len)


def _layer(unit: str) -> int:
    return next(index for index, (_, names) in enumerate(LAYERS) if unit in names)


def _modules() -> Dict[str, Path]:
    found = {}
    for folder, installed in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((installed, *parts))] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> Iterator[Tuple[str, str, int]]:
    """(module imported, name taken from it or "", line) for each of commlib's
    imports in ``module``."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, "", node.lineno) for alias in node.names
                        if alias.name.split(".")[0] == "commlib")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "commlib":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:  # `from package import module`
                    yield submodule, "", node.lineno
                else:
                    yield source, alias.name, node.lineno


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _findings() -> Tuple[List[str], List[str], Dict[Tuple[str, str], str]]:
    upward, private, edges = [], [], {}
    for module, path in MODULES.items():
        where = path.relative_to(ROOT)
        for source, name, line in _imports(module, path):
            unit, target = _unit(module), _unit(source)
            if _layer(target) > _layer(unit):
                upward.append(f"{where}:{line}: {unit} ({LAYERS[_layer(unit)][0]}) imports "
                              f"{source} ({LAYERS[_layer(target)][0]}, a layer above)")
            if unit != target:
                edges.setdefault((unit, target), f"{where}:{line}")
            if name.startswith("_") and not name.startswith("__") and source != module:
                private.append(f"{where}:{line}: imports {source}'s private name {name}")
            owner = source.rsplit(".", 1)[0]
            if _private(source) and not (module == owner or module.startswith(owner + ".")):
                private.append(f"{where}:{line}: imports {source}, private to {owner}")
    return upward, private, edges


UPWARD, PRIVATE, EDGES = _findings()


def test_the_layer_table_holds_every_module():
    assert all(_unit(module) for module in MODULES)


def test_no_package_imports_a_layer_above_it():
    assert not UPWARD, "\n".join(UPWARD)


def test_no_cycle_between_packages():
    both_ways = [f"{a} <-> {b}: {EDGES[a, b]} and {EDGES[b, a]}"
                 for a, b in EDGES if (b, a) in EDGES and a < b]
    assert not both_ways, "\n".join(both_ways)


def test_no_module_imports_another_modules_private_names():
    assert not PRIVATE, "\n".join(PRIVATE)


@pytest.mark.parametrize("source, expected", [
    ("from ..kernels import Kernel", "commlib.kernels"),
    ("from . import tiled", "commlib.kernels.tiled"),
])
def test_relative_imports_resolve_as_python_does(tmp_path, source, expected):
    """The parser above against two spellings from commlib/kernels/__init__.py's package."""
    path = tmp_path / "blockwise.py"
    path.write_text(source + "\n")
    assert [found for found, _, _ in _imports("commlib.kernels.blockwise", path)] == [expected]

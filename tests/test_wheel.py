"""The wheel holds every module of the tree (the packages are found, not
listed: a new subpackage cannot go missing from it), and the ``commlib``
command it declares starts from the wheel's own files."""

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"commlib": "commlib", "bindings": "commlib/bindings", "tools": "commlib/tools"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Built from a copy of the tree: setuptools reuses a checkout's build/
    folder, which can hold modules the tree no longer has."""
    source, out = tmp_path_factory.mktemp("source") / "commlib", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", ".*venv*", "__pycache__", ".*_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(source)], check=True, timeout=300)
    (built,) = out.glob("commlib-*.whl")
    return built


def test_every_module_of_the_tree_is_in_the_wheel(wheel):
    tree = {f"{installed}/{path.relative_to(ROOT / folder).as_posix()}"
            for folder, installed in FOLDERS.items() for path in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in path.parts}
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    assert tree - packed == set(), "modules missing from the wheel"
    assert packed - tree == set(), "modules in the wheel that the tree lacks"


def test_the_commlib_command_starts_from_the_wheel(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as unpacked:
        unpacked.extractall(tmp_path)
        (entry_points,) = [name for name in unpacked.namelist()
                           if name.endswith(".dist-info/entry_points.txt")]
    scripts = configparser.ConfigParser()
    scripts.read(tmp_path / entry_points)
    module, function = scripts["console_scripts"]["commlib"].split(":")
    started = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.argv[0] = 'commlib'; "
         f"from {module} import {function}; {function}()", "--help"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert started.returncode == 0, started.stderr
    assert "diag" in started.stdout and str(tmp_path) in subprocess.run(
        [sys.executable, "-c", "import commlib; print(commlib.__file__)"], cwd=tmp_path,
        capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}).stdout

"""The packages, found rather than listed: ``commlib/`` is ``commlib``,
``bindings/`` is ``commlib.bindings`` and ``tools/`` is ``commlib.tools``,
each with every package below it. pyproject.toml holds the rest."""

from setuptools import find_packages, setup

FOLDERS = {"commlib": "commlib", "commlib.bindings": "bindings", "commlib.tools": "tools"}

setup(packages=[f"{name}.{sub}" if sub else name for name, folder in FOLDERS.items()
                for sub in ["", *find_packages(folder)]],
      package_dir={name: folder for name, folder in FOLDERS.items() if name != folder})

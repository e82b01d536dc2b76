"""setuptools' package list; everything else is in pyproject.toml.

The repository root is the package ``k3serve`` (``package-dir`` in pyproject.toml), so
``[tool.setuptools.packages.find]`` would name its subpackages ``model``, ``server``, ... without
the ``k3serve.`` prefix. Here they are found the same way and prefixed: every folder below the
root that holds an ``__init__.py``, except the test suite and the scripts. ``find_packages``
already skips folders without ``__init__.py`` and those with a dot in the name (``.venv``,
``.git``). ``script_name`` keeps this file out of the root package: setuptools leaves out the
setup script, but under pip it takes the script's name from ``sys.argv[0]``, pip's own.
"""
from setuptools import find_packages, setup

NOT_SHIPPED = ["tests", "tests.*", "tools", "tools.*", "build", "build.*", "dist", "dist.*"]

setup(
    packages=["k3serve"] + [f"k3serve.{p}" for p in find_packages(where=".", exclude=NOT_SHIPPED)],
    script_name="setup.py",  # relative: the build runs in this folder
)

"""Installs the top-level folders under one import namespace of ours: ``server/`` as ``xinserve.server``,
``engines/`` as ``xinserve.engines``, ``kernels/`` as ``xinserve.kernels``, ``config/`` as ``xinserve.config``.

Their bare names are other distributions' on PyPI (transformers imports Hugging Face's ``kernels``), so none
of them is ever installed or imported at the top level. ``kernels/`` and ``config/`` carry no ``__init__.py``:
from the checkout root, where the current directory comes first on ``sys.path``, a bare ``import kernels``
then still finds Hugging Face's package. Everything else about the project is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

FOLDERS = ("server", "engines", "kernels", "config")

package_dir = {f"xinserve.{folder}": folder for folder in FOLDERS}
packages = [
    f"xinserve.{folder}{'.' + sub if sub else ''}"
    for folder in FOLDERS
    for sub in ["", *find_namespace_packages(folder, exclude=["*__pycache__*"])]
]

setup(packages=packages, package_dir=package_dir)

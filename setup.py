"""Package discovery for dsa-train (everything else is in pyproject.toml).

Every directory under `dsa_train/`, `dsa_kernels/` and `recipes/` (imported
as `dsa_train.recipes`) becomes a package of the wheel, data-only ones included, so that a new
subpackage cannot be left out of the wheel by a hand-written list (the wheel once lacked
`dsa_train.eval`, which the trainer imports). tests/test_packaging.py compares the built wheel with
the source tree.
"""

from setuptools import find_namespace_packages, setup

EXCLUDE = ["*__pycache__*", "*.egg-info*"]


def packages_under(root: str, name: str) -> list[str]:
    found = find_namespace_packages(where=root, exclude=EXCLUDE)
    return [name] + [f"{name}.{sub}" for sub in found]


PACKAGE_DIR = {"dsa_train.recipes": "recipes"}


def discover() -> list[str]:
    own = [p for p in find_namespace_packages(include=["dsa_train", "dsa_train.*"], exclude=EXCLUDE)]
    return sorted(own + packages_under("dsa_kernels", "dsa_kernels") + packages_under("recipes", "dsa_train.recipes"))


setup(packages=discover(), package_dir=PACKAGE_DIR)

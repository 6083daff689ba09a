"""Package discovery (everything else is in pyproject.toml).

Packages are found, never listed by hand: a package missing from the wheel (as
``agentserver.http.routes`` once was) breaks every install that is not editable.
``listeners/``, ``primitives/`` and ``schemas/`` sit at the top of the repository but
install as ``agentserver.listeners``, ``agentserver.primitives`` and
``agentserver.schemas``, so their import names can never collide with another
distribution's; pyproject.toml alone cannot discover packages under a renamed folder,
hence this file. tests/test_wheel.py builds the wheel and checks that every package and
data file of the source tree is in it.
"""

from setuptools import find_packages, setup

#: Top-level folders installed under another name (import name -> folder).
RENAMED = {
    "agentserver.listeners": "listeners",
    "agentserver.primitives": "primitives",
    "agentserver.schemas": "schemas",
}

packages = find_packages(include=["agentserver", "agentserver.*"])
for name, folder in RENAMED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir={"agentserver": "agentserver", **RENAMED})

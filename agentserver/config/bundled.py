"""The bundled topology, so ``agentserver run`` has something to run when installed from a
wheel and started outside a checkout.

``agentserver/config/bundled_boot.xml`` is a symbolic link to the repository's ``boot.xml``: one
file, which the wheel build copies in as package data.
"""

from __future__ import annotations

import importlib.resources

BOOT_XML = (
    importlib.resources.files("agentserver.config").joinpath("bundled_boot.xml").read_text("utf-8")
)

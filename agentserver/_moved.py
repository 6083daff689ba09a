"""Import paths of modules that moved into the layer packages, kept working for users.

Before the tree was split by layer (docs/architecture.md) every module sat directly in
``agentserver/``; users' code, deployments and docs import several of them by that path
(``agentserver.listener``, ``agentserver.client``, ``agentserver.testing``, ...).
Rather than a shim file per old module in the top folder (which would hide the layers
again), one import hook maps each old name to the module that now holds it: importing
the old name returns that very module object, so ``isinstance`` checks, monkeypatching
and ``python -m agentserver.OLD`` behave exactly as before. The canonical paths are the
new ones (docs/api.md lists the public API); this table only ever grows.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

#: Old module path (under ``agentserver.``) -> the module that holds it now.
MOVED: dict[str, str] = {
    "errors": "core.errors",
    "namespaces": "core.namespaces",
    "xmlsafe": "core.xmlsafe",
    "xsdgen": "core.xsdgen",
    "xsdpayload": "core.xsdpayload",
    "payloads": "core.payloads",
    "envelope": "core.envelope",
    "listener": "core.listener",
    "handler_types": "core.handler_types",
    "routing": "core.routing",
    "threads": "core.threads",
    "usage": "core.usage",
    "framing": "core.framing",
    "handshake": "core.handshake",
    "throttle": "core.throttle",
    "schemas_export": "core.schemas_export",
    "endpoint": "pump.endpoint",
    "server": "net.server",
    "tls": "net.tls",
    "client": "net.client",
    "runners": "remote.hub",
    "runner": "remote.runner",
    "topology": "config.topology",
    "boot": "config.loader",
    "bundled": "config.bundled",
    "operator": "console.operator",
    "console_ops": "console.commands",
    "remote_console": "console.remote",
    "terminal": "console.terminal",
    "builtins": "app.builtins",
    "testing": "app.testing",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module that now holds it (imported once, not twice)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias's spec on the shared module object: give it
        # its own back, or a later reload or pickle would look for the old name.
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        # ``python -m agentserver.OLD`` (runpy) runs the new module's code.
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        get_code = getattr(loader, "get_code", None)
        return get_code(self.target) if get_code is not None else None

    def is_package(self, fullname: str) -> bool:
        return False


class MovedModules(importlib.abc.MetaPathFinder):
    """The finder for :data:`MOVED`; :func:`install` puts one on ``sys.meta_path``."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, rest = fullname.partition(".")
        if prefix != "agentserver" or rest not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"agentserver.{MOVED[rest]}"))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per interpreter."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())

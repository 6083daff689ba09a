"""Import paths the docs once published, kept working until :data:`REMOVAL`, with a warning.

Modules move between releases (docs/architecture.md: the layers, the agents' floors); what
users may rely on is docs/api.md: the face modules (``agentserver.listener``,
``agentserver.client``, ``agentserver.testing``) and a few deep names. A module path that
a version of the docs (docs/api.md, README.md, docs/*.md) told users to import, and that
has since moved, is mapped here to the module that holds it now: importing the old path
returns that very module object (so ``isinstance`` checks and monkeypatching behave as
before, and ``python -m agentserver.OLD`` runs the new module) and emits a
``DeprecationWarning`` naming the release that removes it. Paths no doc ever published
are not mapped: they were internal. Nothing inside the package or its tests imports an
old path (tests/test_layers.py checks it).

This module is part of the package root: it imports no layer (the targets are imported
by name, when an old path is asked for).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

#: The release that removes every path below (docs/api.md "Old import paths", CHANGELOG).
REMOVAL = "0.3"

#: Old module path (under ``agentserver.``) -> the module that holds it now. Each was
#: published by the docs: the flat modules of before the layers (docs/wire.md,
#: docs/protocol.md), the flat ``agents/`` modules docs/api.md listed before the floors.
MOVED: dict[str, str] = {
    "errors": "core.errors",
    "framing": "core.framing",
    "handshake": "core.handshake",
    "runner": "remote.runner",
    "schemas_export": "core.schemas_export",
    "agents.bridge": "agents.edge.bridge",
    "agents.guardrails": "agents.policy.guardrails",
    "agents.record": "agents.replay.record",
    "agents.retry": "agents.profile.retry",
    "agents.settings": "agents.profile.settings",
}

#: Old modules whose path is now a package of the same name: the package forwards the old
#: module's names (its ``__getattr__`` calls :func:`moved_attribute`). Old path -> (the
#: module that holds the names now, the names). ``agentserver.agents.policy.evaluate``
#: is both a name of the old module and a submodule of the package: that submodule calls
#: its function (:func:`calls_its_function`).
MOVED_NAMES: dict[str, tuple[str, frozenset[str]]] = {
    "agents.policy": (
        "agents.policy.evaluate",
        frozenset(
            {
                "DEFAULT_APPROVAL_TIMEOUT_S",
                "ArgPredicate",
                "CallInfo",
                "Decision",
                "Policy",
                "PolicyError",
                "Rate",
                "RateScope",
                "Rule",
                "Verdict",
                "approvers",
                "parse_arg",
                "parse_duration",
                "parse_policy",
                "parse_rate",
                "parse_rule",
                "policy_problems",
                "rate_key",
            }
        ),
    ),
    "agents.profile": (
        "agents.profile.agent",
        frozenset({"AgentProfile", "ResultField", "DEFAULT_MAX_OUTPUT", "SUBMIT_RESULT"}),
    ),
}


def deprecated(old: str, new: str, *, stacklevel: int) -> None:
    """Warn that ``agentserver.OLD`` is deprecated; ``stacklevel`` as for
    :func:`warnings.warn`, counted from the caller (import machinery frames are skipped
    by :mod:`warnings` itself, so the warning points at the user's import)."""
    warnings.warn(
        f"agentserver.{old} is deprecated and will be removed in agentserver {REMOVAL}: "
        f"import agentserver.{new} (docs/api.md lists the public import paths)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def moved_attribute(package: str, name: str) -> object:
    """An old module's name, looked up on the package that replaced it (that package's
    module ``__getattr__``); AttributeError for any other name, as usual."""
    old = package.removeprefix("agentserver.")
    target, names = MOVED_NAMES.get(old, ("", frozenset()))
    if name not in names:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    # stacklevel 3: this function, the package's __getattr__, then the user's import.
    deprecated(f"{old}.{name}", f"{target}.{name}", stacklevel=3)
    return getattr(importlib.import_module(f"agentserver.{target}"), name)


#: Module name -> (the function it calls, its old path, its new path): see
#: :func:`calls_its_function`.
_CALLS: dict[str, tuple[Callable[..., Any], str, str]] = {}


class _FunctionModule(types.ModuleType):
    """A module that also calls the function it was named after (:func:`calls_its_function`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function, old, new = _CALLS[self.__name__]
        deprecated(old, new, stacklevel=2)
        return function(*args, **kwargs)


def calls_its_function(module_name: str, function: Callable[..., Any], old: str) -> None:
    """Make module ``module_name`` callable as ``function``, with the deprecation warning
    for the old name ``agentserver.OLD``: a package replaced a module whose function had
    the name the package's submodule now has, so ``from PACKAGE import NAME`` finds the
    submodule where it found the function."""
    new = f"{module_name}.{function.__name__}".removeprefix("agentserver.")
    _CALLS[module_name] = (function, old, new)
    sys.modules[module_name].__class__ = _FunctionModule


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module that now holds it (imported once, not twice)."""

    def __init__(self, old: str) -> None:
        self.old = old
        self.target = f"agentserver.{MOVED[old]}"
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # stacklevel 2: this method, then (past the import system's frames) the import.
        deprecated(self.old, MOVED[self.old], stacklevel=2)
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias's spec on the shared module object: give it
        # its own back, or a later reload or pickle would look for the old name.
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        # ``python -m agentserver.OLD`` (runpy) runs the new module's code; runpy never
        # calls create_module, so the warning is given here.
        deprecated(self.old, MOVED[self.old], stacklevel=2)
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        get_code = getattr(loader, "get_code", None)
        return get_code(self.target) if get_code is not None else None

    def is_package(self, fullname: str) -> bool:
        return False


class MovedModules(importlib.abc.MetaPathFinder):
    """The finder for :data:`MOVED`; :func:`install` puts one on ``sys.meta_path``.

    It comes after the ordinary finders, so it is asked only about a path that no longer
    exists as a file."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, rest = fullname.partition(".")
        if prefix != "agentserver" or rest not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(rest))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per interpreter."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())

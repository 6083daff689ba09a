"""boot.xml's import references (``package.module:attr``) and the folder they import from."""

from __future__ import annotations

import importlib
import pathlib
import sys
from typing import Any

from lxml import etree

from agentserver.core.namespaces import BOOT_NS

#: Every element of boot.xml is in this namespace; ``B + "listener"`` is a tag.
B = f"{{{BOOT_NS}}}"


class Unresolved(Exception):
    """A reference in boot.xml that does not resolve (message is user-facing).

    ``module`` is set when the module itself failed to import: later references to it
    would only repeat that error."""

    def __init__(self, message: str, module: str | None = None) -> None:
        super().__init__(message)
        self.module = module


def add_import_dir(directory: pathlib.Path) -> None:
    """Put ``directory`` (boot.xml's) first on the import path, as Python does for a
    script's directory, so a module written next to boot.xml imports with no
    ``PYTHONPATH``. It stays there: a handler may import more of its siblings later."""
    entry = str(directory.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()


def resolve_import(ref: str) -> Any:
    """``package.module:attr.sub`` → the object. Raises :class:`Unresolved` with the reason."""
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise Unresolved(f"{ref!r} is not module:name")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any failure of user code at import time is a config error
        raise Unresolved(f"cannot import module {module_name!r}: {exc}", module_name) from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise Unresolved(f"module {module_name!r} has no {attr_path!r}") from None
    return obj


class Resolver:
    """:func:`resolve_import` for one file: a module that failed to import is reported
    once, its later references raise :class:`Unresolved` with an empty message."""

    def __init__(self) -> None:
        self.failed_modules: set[str] = set()

    def resolve(self, ref: str) -> Any:
        module = ref.partition(":")[0]
        if module in self.failed_modules:
            raise Unresolved("", module)  # reported already
        try:
            return resolve_import(ref)
        except Unresolved as exc:
            if exc.module is not None:
                self.failed_modules.add(exc.module)
            raise


def flag(el: etree._Element, attr: str, default: bool = False) -> bool:
    """A boolean attribute (``true``/``1``; the schema checked the spelling)."""
    value = el.get(attr)
    return default if value is None else value.strip() in ("true", "1")

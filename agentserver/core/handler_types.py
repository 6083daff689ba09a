"""What a handler says it can read, from the annotation of its payload parameter.

The pump hands a handler the ``<huh>``/``<SystemError>`` its own output earned, or its
callee's failure. A handler written for its own payload model (``payload: Reverse``)
cannot read them: calling it would only crash it. So a primitive goes to a handler only
if its annotation admits it (``Reverse | Huh``, ``BaseXmlModel``, ``Any``, or none at
all); otherwise the pump passes the failure to the handler's caller instead
(docs/protocol.md, "Handlers"). Pure: no I/O, computed once per listener.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any


def _payload_annotation(handler: Callable[..., Any]) -> Any:
    """The first parameter's annotation, resolved; ``Any`` when there is none or it
    cannot be resolved (then the handler is trusted to read anything, as before)."""
    target = handler
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        call = getattr(handler, "__call__", None)  # noqa: B004 - a callable object's method
        if inspect.ismethod(call) or inspect.isfunction(call):
            target = call
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return Any
    if not params or params[0].annotation is inspect.Parameter.empty:
        return Any
    try:
        hints = typing.get_type_hints(inspect.unwrap(target))
    except Exception:  # a forward reference that does not resolve: trust the handler
        return Any
    return hints.get(params[0].name, Any)


def _admits(annotation: Any, model: type) -> bool:
    if annotation is Any or annotation is object:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_admits(arg, model) for arg in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _admits(typing.get_args(annotation)[0], model)
    if isinstance(annotation, type):
        return issubclass(model, annotation)
    return True  # a TypeVar, a Protocol, ...: not ours to second-guess


def unreadable(
    handler: Callable[..., Any], models: Iterable[type], *, raw: bool = False
) -> frozenset[type]:
    """Of ``models`` (the core primitives), those ``handler`` cannot be given. A raw
    handler takes elements and reads any tag, so it can be given all of them."""
    if raw:
        return frozenset()
    annotation = _payload_annotation(handler)
    return frozenset(m for m in models if not _admits(annotation, m))

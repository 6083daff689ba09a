"""Structured logs: structlog renders every record, stdlib ``logging`` calls included.

Each record carries the message chain it belongs to: ``listener``, ``thread`` (the hop the
listener works on, as its handler's ``meta.thread_id``) and ``caller_thread`` (the
sender's thread: a client's conversation thread) while a pump worker handles a message
(read from the worker's slot, so the pump binds nothing per message); ``agent``, ``turn``,
``thread`` and ``caller_thread`` while an agent runs a Turn (bound with
:func:`structlog.contextvars.bound_contextvars`; trio gives each task its own context).
Fields are listed in docs/operations.md.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

#: The pump worker slot of the current trio task (set once per worker task by the pump).
#: A context variable is per task by nature; it holds no state of its own.
current_slot: ContextVar[Any] = ContextVar("agentserver_pump_slot", default=None)

LOG_FORMATS = ("text", "json")

#: The LogRecord attribute :func:`announce` carries its fields in (read by add_fields).
FIELDS_ATTRIBUTE = "agentserver_fields"


def add_chain(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Add the thread and listener of the pump delivery being handled, if any."""
    slot = current_slot.get()
    if slot is not None:
        event.setdefault("listener", slot.listener)
        delivery = slot.delivery
        if delivery is not None:
            thread = delivery.thread
            event.setdefault("thread", thread.id)
            if thread.parent is not None:
                event.setdefault("caller_thread", thread.parent)
    return event


def add_fields(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Add the fields an :func:`announce` record carries (a stdlib record has no keys of
    its own); any other record is left as it is."""
    fields = getattr(event.get("_record"), FIELDS_ATTRIBUTE, None)
    if isinstance(fields, dict):
        for key, value in fields.items():
            event.setdefault(key, value)
    return event


def announce(logger: logging.Logger, event: str, **fields: Any) -> None:
    """Log ``event`` at INFO with ``fields`` (keys of its JSON object), whatever the level
    is set to: a line that tools wait for, such as ``agentserver listening on HOST:PORT``,
    must not be hidden by ``--log-level warning``. One record through the logger's
    filters and handlers, written before this returns (a StreamHandler flushes each
    record); nothing is kept. ``fields`` must be JSON-serialisable."""
    record = logger.makeRecord(
        logger.name,
        logging.INFO,
        "(announce)",
        0,
        event,
        (),
        None,
        extra={FIELDS_ATTRIBUTE: fields},
    )
    # handle(), not info(): it skips the logger's level check, not its filters.
    logger.handle(record)


def default_format(stream: TextIO) -> str:
    """``text`` on a terminal, ``json`` otherwise (files, pipes, log collectors)."""
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


def configure_logging(level: str, fmt: str | None = None, stream: TextIO | None = None) -> str:
    """Route stdlib logging and structlog to ``stream`` (stderr) in ``fmt``; returns the
    format used. Called once by the CLI (the process's composition root)."""
    stream = stream if stream is not None else sys.stderr
    fmt = fmt or default_format(stream)
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(LOG_FORMATS)}")
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        add_chain,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        final: list[Processor] = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        final = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.dev.ConsoleRenderer(colors=_colors(stream)),
        ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, add_fields], processors=final
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return fmt


def _colors(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

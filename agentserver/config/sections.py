"""boot.xml's sections with no references in them: ``<limits>``, ``<http>``, ``<llm>``
(the LLM router's settings) and ``<store>`` (the agents' store, its relative SQLite path
resolved against boot.xml's folder). Each is read once, here, into its typed settings."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

from lxml import etree

from agentserver.agents.errors import AgentConfigError
from agentserver.agents.profile.config import store_settings_from_element
from agentserver.agents.profile.settings import StoreSettings
from agentserver.config.clients import is_loopback
from agentserver.config.problems import Report
from agentserver.config.topology import DEFAULT_HOST, DEFAULT_HTTP_PORT, HttpSpec, Limits
from agentserver.core.durations import parse_duration
from agentserver.llm.config import RouterConfig, check_llm_section


class SectionReader:
    """Reads the plain sections of one boot.xml, reporting to ``report``. ``base_dir`` is
    boot.xml's folder (absolute); ``environ`` resolves the ``*-env`` overrides."""

    def __init__(self, report: Report, base_dir: pathlib.Path, environ: Mapping[str, str]) -> None:
        self.report = report
        self.base_dir = base_dir
        self.environ = environ

    def error(self, line: int | None, message: str) -> None:
        self.report.error(line, message)

    def warn(self, line: int | None, message: str) -> None:
        self.report.warn(line, message)

    def http(self, el: etree._Element | None, clients: bool) -> HttpSpec | None:
        """``<http>``; the same address rules as ``<listen>`` (checked again by ``run``)."""
        if el is None:
            return None
        default = HttpSpec()
        spec = HttpSpec(
            host=el.get("host", DEFAULT_HOST),
            port=int(el.get("port", DEFAULT_HTTP_PORT)),
            max_pending=int(el.get("max-pending", default.max_pending)),
            reply_ttl=_seconds(el, "reply-ttl", default.reply_ttl),
            max_replies=int(el.get("max-replies", default.max_replies)),
            wait_timeout=_seconds(el, "wait-timeout", default.wait_timeout),
            ui_session_ttl=_seconds(el, "ui-session-ttl", default.ui_session_ttl),
            line=el.sourceline or 0,
        )
        if not is_loopback(spec.host):
            if not clients:
                self.warn(
                    el.sourceline,
                    f"<http> on non-loopback {spec.host} without declared clients: 'run' "
                    "refuses it unless started with --insecure, and anonymous HTTP callers "
                    "are served only from loopback addresses",
                )
        return spec

    def limits(self, el: etree._Element | None) -> Limits:
        if el is None:
            return Limits()
        d = Limits()
        # One keyword per field, so each is typed (tests/test_boot_load.py checks all are
        # read). The schema made each an integer or a duration: int() keeps every digit.
        limits = Limits(
            max_connections=_count(el, "max-connections", d.max_connections),
            max_inflight=_count(el, "max-inflight", d.max_inflight),
            max_inflight_bytes=_count(el, "max-inflight-bytes", d.max_inflight_bytes),
            inflight_ttl=_seconds(el, "inflight-ttl", d.inflight_ttl),
            outgoing_buffer=_count(el, "outgoing-buffer", d.outgoing_buffer),
            outgoing_buffer_bytes=_count(el, "outgoing-buffer-bytes", d.outgoing_buffer_bytes),
            max_message_bytes=_count(el, "max-message-bytes", d.max_message_bytes),
            read_timeout=_seconds(el, "read-timeout", d.read_timeout),
            write_timeout=_seconds(el, "write-timeout", d.write_timeout),
            hello_timeout=_seconds(el, "hello-timeout", d.hello_timeout),
            idle_timeout=_seconds(el, "idle-timeout", d.idle_timeout),
            drain_timeout=_seconds(el, "drain-timeout", d.drain_timeout),
            delivery_timeout=_seconds(el, "delivery-timeout", d.delivery_timeout),
            max_threads=_count(el, "max-threads", d.max_threads),
            max_threads_per_connection=_count(
                el, "max-threads-per-connection", d.max_threads_per_connection
            ),
            thread_ttl=_seconds(el, "thread-ttl", d.thread_ttl),
        )
        if limits.outgoing_buffer < limits.max_inflight:
            self.warn(
                el.sourceline,
                f"outgoing-buffer ({limits.outgoing_buffer}) is smaller than max-inflight "
                f"({limits.max_inflight}): a client with many requests in flight may be "
                "disconnected for reading too slowly",
            )
        if limits.max_threads_per_connection >= limits.max_threads:
            self.warn(
                el.sourceline,
                f"max-threads-per-connection ({limits.max_threads_per_connection}) is not below "
                f"max-threads ({limits.max_threads}): one client can fill the thread registry "
                "and have every other refused",
            )
        return limits

    def llm(self, el: etree._Element | None) -> RouterConfig | None:
        """``<llm>`` checked and parsed (None: absent, or errors were reported)."""
        if el is None:
            return None
        try:
            report = check_llm_section(el, environ=self.environ, validate=False)
        except Exception as exc:
            self.error(el.sourceline, f"<llm>: {exc}")
            return None
        for line, message in report.errors:
            self.error(line or el.sourceline, message)
        for line, message in report.warnings:
            self.warn(line or el.sourceline, message)
        return report.config

    def store(self, el: etree._Element | None) -> StoreSettings:
        """``<store>`` (its defaults when absent), the SQLite path resolved against
        boot.xml's folder and ``url-env`` read from the environment now."""
        try:
            settings = store_settings_from_element(el, base_dir=self.base_dir, environ=self.environ)
        except AgentConfigError as exc:
            assert el is not None  # the defaults are valid
            self.error(el.sourceline, f"<store>: {exc}")
            return StoreSettings(path=self.base_dir / StoreSettings().path)
        var = el.get("url-env") if el is not None else None
        if var and not self.environ.get(var) and settings.url is None:
            self.warn(
                el.sourceline if el is not None else 0,
                f"<store url-env>: ${var} is not set and there is no url: the agents' store "
                f"is the SQLite file {settings.path}",
            )
        return settings


def _count(el: etree._Element, attr: str, default: int) -> int:
    """An integer attribute (schema-valid, so it parses), or ``default``."""
    raw = el.get(attr)
    return default if raw is None else int(raw)


def _seconds(el: etree._Element, attr: str, default: float) -> float:
    """A duration attribute (schema-valid, so it parses), or ``default``."""
    raw = el.get(attr)
    return default if raw is None else parse_duration(raw)

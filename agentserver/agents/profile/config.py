"""boot.xml elements (``StoreSectionType``, ``AgentProfileType``) → settings dataclasses,
and an agent's settings → its :class:`AgentProfile`.

The elements are expected to have been validated against ``boot.xsd`` (which includes
``boot-agents.xsd``); defaults here equal the schema's, so an absent attribute and a
schema-filled default give the same result. Invalid values raise ``AgentConfigError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from lxml import etree

from agentserver.agents.errors import AgentConfigError
from agentserver.agents.profile.agent import AgentProfile, ResultField
from agentserver.agents.profile.retention import (
    agent_retention_from_element,
    retention_from_element,
)
from agentserver.agents.profile.settings import AgentSettings, StoreSettings, profile_default
from agentserver.core.durations import DurationError, parse_duration
from agentserver.core.namespaces import BOOT_NS

SCHEMA_FILE = "boot-agents.xsd"
MODEL_ENV = "AGENTSERVER_MODEL"


def schema_file() -> Traversable:
    """``boot-agents.xsd`` as installed package data."""
    return resources.files("agentserver.schemas") / SCHEMA_FILE


def _q(local: str) -> str:
    return etree.QName(BOOT_NS, local).text


def _num(el: etree._Element, attr: str, default: float, kind: type = float) -> float:
    raw = el.get(attr)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise AgentConfigError(
            f"<{etree.QName(el).localname}> {attr}={raw!r} is not a number"
        ) from None


def _seconds(el: etree._Element, attr: str, default: float) -> float:
    """A duration attribute (boot.xml's one syntax: ``30``, ``250ms``, ``5m``, ...)."""
    raw = el.get(attr)
    if raw is None:
        return default
    try:
        return parse_duration(raw)
    except DurationError as exc:
        raise AgentConfigError(f"<{etree.QName(el).localname} {attr}>: {exc}") from None


def store_url(el: etree._Element, environ: Mapping[str, str] | None = None) -> str | None:
    """``<store url>``, or the value of its ``url-env`` variable when that is set; checked
    (``AgentConfigError``). None: the store is the SQLite file."""
    env = os.environ if environ is None else environ
    var = el.get("url-env")
    url = (env.get(var) if var else None) or el.get("url")
    if not url:
        return None
    from agentserver.agents.profile.store_url import StoreUrlError, check_url

    try:
        return check_url(url)
    except StoreUrlError as exc:
        source = f"${var}" if var and env.get(var) else "url"
        raise AgentConfigError(f"{source}: {exc}") from None


def store_settings_from_element(
    el: etree._Element | None,
    *,
    base_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> StoreSettings:
    """Settings from a ``StoreSectionType`` element (``None``: all defaults); ``url-env``
    is read from ``environ`` (default: the process environment)."""
    d = StoreSettings()
    if el is None:
        path = d.path
    else:
        path = Path(el.get("path", str(d.path)))
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if el is None:
        return StoreSettings(path=path)
    try:
        return StoreSettings(
            path=path,
            url=store_url(el, environ),
            lease_s=_seconds(el, "lease", d.lease_s),
            heartbeat_s=_seconds(el, "heartbeat", d.heartbeat_s),
            pool_size=int(_num(el, "pool-size", d.pool_size, int)),
            worker_concurrency=int(_num(el, "worker-concurrency", d.worker_concurrency, int)),
            watchdog_interval_s=_seconds(el, "watchdog-interval", d.watchdog_interval_s),
            processing_timeout_s=_seconds(el, "processing-timeout", d.processing_timeout_s),
            dispatch_timeout_s=_seconds(el, "dispatch-timeout", d.dispatch_timeout_s),
            max_running_s=_seconds(el, "max-running", d.max_running_s),
            retry_base_s=_seconds(el, "retry-base", d.retry_base_s),
            max_retries=int(_num(el, "max-retries", d.max_retries, int)),
            client_replies_max=int(_num(el, "client-replies-max", d.client_replies_max, int)),
            retention=retention_from_element(el.find(_q("retention"))),
        )
    except ValueError as exc:
        raise AgentConfigError(str(exc)) from None


def agent_settings_from_element(el: etree._Element | None, *, name: str) -> AgentSettings:
    """:class:`AgentSettings` from an ``AgentProfileType`` element (None: all defaults).
    Raises ``AgentConfigError`` naming agent ``name`` for a value it cannot use."""
    if el is None:
        return AgentSettings()
    prompt_el = el.find(_q("system-prompt"))
    fields = tuple(
        ResultField(
            f.get("name", ""),
            f.get("required", "true") in ("true", "1"),
            (f.text or "").strip(),
        )
        for f in el.iterfind(_q("result-field"))
    )
    d = AgentSettings()
    max_tokens = el.get("max-tokens")
    try:
        return AgentSettings(
            model=el.get("model") or None,
            model_env=el.get("model-env") or None,
            system_prompt=(prompt_el.text or "").strip() if prompt_el is not None else None,
            max_steps=int(_num(el, "max-steps", d.max_steps, int)),
            resume_deadline_s=_seconds(el, "resume-deadline", d.resume_deadline_s),
            llm_timeout_s=_seconds(el, "llm-timeout", d.llm_timeout_s),
            max_tokens=int(max_tokens) if max_tokens else None,
            step_retries=int(_num(el, "step-retries", d.step_retries, int)),
            step_retry_base_s=_seconds(el, "step-retry-base", d.step_retry_base_s),
            max_retry_after_s=_seconds(el, "max-retry-after", d.max_retry_after_s),
            context_window=int(window) if (window := el.get("context-window")) else None,
            context_reserve=int(_num(el, "context-reserve", d.context_reserve, int)),
            keep_recent=int(_num(el, "keep-recent", d.keep_recent, int)),
            tool_result_share=_num(el, "tool-result-share", d.tool_result_share),
            memory=el.get("memory", d.memory),
            multitask=el.get("multitask", d.multitask),
            must_end_with=tuple((m.text or "").strip() for m in el.iterfind(_q("must-end-with"))),
            result_fields=fields,
            terminate_tools=tuple(
                (t.text or "").strip() for t in el.iterfind(_q("terminate-tool"))
            ),
            loop_warn=int(_num(el, "loop-warn", d.loop_warn, int)),
            loop_block=int(_num(el, "loop-block", d.loop_block, int)),
            retention=agent_retention_from_element(el.find(_q("retention"))),
            version=el.get("version") or None,
            versioning=el.get("versioning", d.versioning),
        )
    except ValueError as exc:
        raise AgentConfigError(f"agent {name!r}: {exc}") from None


def profile_from_settings(
    settings: AgentSettings,
    *,
    name: str,
    own_roots: tuple[str, ...],
    peers: Mapping[str, str],
    usage_instructions: str = "",
    answer_tag: str = "",
    environ: Mapping[str, str] | None = None,
) -> AgentProfile:
    """An :class:`AgentProfile` from an agent's ``<agent>`` settings plus what the pump
    knows: the agent's own root tags, its peers' root tags (Clark → listener name), the
    generated ``usage_instructions`` and the reply's root tag (default ``{ns}answer`` in
    the namespace of the first own root tag). The model is ``settings.model_env``'s value
    if set, else ``settings.model``, else ``AGENTSERVER_MODEL`` (read from ``environ``,
    default the process environment). Raises ``AgentConfigError``."""
    env = os.environ if environ is None else environ
    override = settings.model_env
    model = (env.get(override) if override else None) or settings.model or env.get(MODEL_ENV, "")
    if not model:
        raise AgentConfigError(f"agent {name!r}: no model (set model= or {MODEL_ENV})")
    s = settings
    try:
        return AgentProfile(
            name=name,
            model=model,
            system_prompt=s.system_prompt
            if s.system_prompt is not None
            else profile_default("system_prompt"),
            max_steps=s.max_steps,
            resume_deadline_s=s.resume_deadline_s,
            llm_timeout_s=s.llm_timeout_s,
            max_tokens=s.max_tokens,
            step_retries=s.step_retries,
            step_retry_base_s=s.step_retry_base_s,
            max_retry_after_s=s.max_retry_after_s,
            context_window=s.context_window,
            context_reserve=s.context_reserve,
            keep_recent=s.keep_recent,
            tool_result_share=s.tool_result_share,
            memory=s.memory,
            multitask=s.multitask,
            must_end_with=s.must_end_with,
            result_fields=s.result_fields,
            terminate_tools=s.terminate_tools,
            usage_instructions=usage_instructions,
            own_roots=own_roots,
            peers=dict(peers),
            answer_tag=answer_tag,
            loop_warn=s.loop_warn,
            loop_block=s.loop_block,
            retention=s.retention,
            versioning=s.versioning,
        )
    except ValueError as exc:
        raise AgentConfigError(f"agent {name!r}: {exc}") from None


def profile_from_element(
    el: etree._Element | None,
    *,
    name: str,
    own_roots: tuple[str, ...],
    peers: Mapping[str, str],
    usage_instructions: str = "",
    answer_tag: str = "",
    environ: Mapping[str, str] | None = None,
) -> AgentProfile:
    """:func:`profile_from_settings` of the ``AgentProfileType`` element ``el``."""
    return profile_from_settings(
        agent_settings_from_element(el, name=name),
        name=name,
        own_roots=own_roots,
        peers=peers,
        usage_instructions=usage_instructions,
        answer_tag=answer_tag,
        environ=environ,
    )

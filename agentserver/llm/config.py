"""Router configuration: dataclasses, and the reader/checker of boot.xml's ``<llm>``.

The grammar is ``schemas/boot-llm.xsd`` (type ``LlmSectionType``).
:func:`parse_llm_section` turns a schema-valid element into a
:class:`RouterConfig`; :func:`check_llm_section` reports what ``agentserver
check`` should print, as ``(line, message)`` pairs, errors and warnings apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from importlib.resources import as_file, files
from typing import TypeVar, overload

from lxml import etree

from agentserver.core.durations import parse_duration
from agentserver.core.namespaces import BOOT_NS

from .types import Usage

T = TypeVar("T")
#: A number an attribute must bound (``_positive``, ``_non_negative``).
N = TypeVar("N", int, float)

__all__ = [
    "BOOT_NS",
    "BackendConfig",
    "BreakerConfig",
    "LlmCheck",
    "LlmConfigError",
    "Price",
    "Provider",
    "RetryConfig",
    "RouterConfig",
    "Strategy",
    "check_llm_section",
    "llm_schema",
    "missing_key_reason",
    "parse_llm_section",
]

_NS = f"{{{BOOT_NS}}}"


class Provider(StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"
    #: A GGUF model run in-process by llama-cpp-python (no HTTP; ``model-path``).
    LLAMA_CPP = "llama-cpp"


class Strategy(StrEnum):
    FAILOVER = "failover"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True, slots=True)
class Price:
    """Prices per million tokens, in whatever currency the operator uses."""

    input_per_million: float
    output_per_million: float

    def cost(self, usage: Usage) -> float:
        return (
            usage.prompt_tokens * self.input_per_million
            + usage.completion_tokens * self.output_per_million
        ) / 1_000_000


@dataclass(frozen=True)
class BackendConfig:
    """One backend.

    ``base_url`` follows each provider's own client convention: for OpenAI-
    compatible servers it includes ``/v1`` (``https://api.openai.com/v1``), for
    Anthropic and Ollama it does not (``https://api.anthropic.com``,
    ``http://localhost:11434``).

    ``models`` are served under their own names; ``aliases`` maps another name
    to one of them. Lookups are exact. ``priority``: lower is preferred.
    ``timeout`` bounds one attempt (and, when streaming, the silence between two
    chunks). ``context_window`` is in tokens; unknown windows never receive a
    context-overflow failover.
    """

    name: str
    provider: Provider
    base_url: str
    models: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)
    api_key_env: str | None = None
    priority: int = 100
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    timeout: float = 60.0
    context_window: int | None = None
    price: Price | None = None
    #: ``<model context-window>``: a model's own window, over the backend's.
    model_windows: Mapping[str, int] = field(default_factory=dict)
    line: int | None = None
    #: llama-cpp only: the GGUF file, or ``packaged:NAME`` (see ``llm/local_models.py``).
    model_path: str | None = None
    #: llama-cpp only: CPU threads for generation (None: llama.cpp's default).
    threads: int | None = None
    #: llama-cpp only: constrain each reply by the agent's reply grammar (built from its
    #: peers' XSDs); other providers ignore it.
    constrain: bool = True
    #: llama-cpp only: the sampling temperature of a request that sets none (None:
    #: llama.cpp's 0.8; 0 decodes greedily, the same prompt giving the same reply).
    temperature: float | None = None
    #: ``unless-env``: the backend is skipped while this environment variable is set (the
    #: bundled boot.xml's local model stands in only without OPENAI_API_KEY).
    unless_env: str | None = None

    def resolve(self, model: str) -> str | None:
        """The provider's model name for ``model`` (a name or alias), or ``None``."""
        if model in self.models:
            return model
        return self.aliases.get(model)


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """``max_attempts`` is the budget of HTTP calls per request, retries and
    failovers together. Backoff without a Retry-After header starts at
    ``base_delay`` and doubles up to ``max_delay`` (with jitter). A provider's
    Retry-After is honoured up to ``max_retry_after``; a longer wait makes the
    router fail over instead of retrying that backend. The same bound caps how long a
    429's Retry-After keeps the backend cooling for every request (then one probe)."""

    max_attempts: int = 4
    base_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 30.0


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failures: int = 3
    cooldown: float = 30.0


@dataclass(frozen=True)
class RouterConfig:
    """``timeout`` is the default deadline of a request that sets none, counted
    from the router receiving it. ``queue_limit`` bounds the callers waiting on
    one backend's rate limiter."""

    backends: tuple[BackendConfig, ...]
    strategy: Strategy = Strategy.FAILOVER
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    timeout: float = 120.0
    queue_limit: int = 1000


def model_context_window(config: RouterConfig, model: str) -> int | None:
    """The declared context window of ``model`` (a name or alias): the smallest over the
    backends that serve it (a request may land on any of them); None when none declares
    one. ``<model context-window>`` wins over its backend's ``context-window``."""
    windows = []
    for backend in config.backends:
        name = backend.resolve(model)
        if name is None:
            continue
        window = backend.model_windows.get(name, backend.context_window)
        if window is not None:
            windows.append(window)
    return min(windows) if windows else None


class LlmConfigError(ValueError):
    """The ``<llm>`` section cannot be turned into a configuration."""

    def __init__(self, line: int | None, message: str) -> None:
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}" if line else message)


@dataclass(frozen=True, slots=True)
class LlmCheck:
    errors: list[tuple[int, str]]
    warnings: list[tuple[int, str]]
    #: The section's configuration (None when it has errors): checked and parsed once.
    config: RouterConfig | None = None

    @property
    def ok(self) -> bool:
        return not self.errors


def missing_key_reason(backend: BackendConfig, environ: Mapping[str, str]) -> str | None:
    """Why ``backend`` cannot run with ``environ``, or ``None`` if it can."""
    if backend.unless_env and environ.get(backend.unless_env):
        return (
            f"environment variable {backend.unless_env} is set, and backend "
            f"{backend.name!r} stands in only without it (unless-env)"
        )
    if backend.api_key_env and not environ.get(backend.api_key_env):
        return (
            f"environment variable {backend.api_key_env} (API key of backend "
            f"{backend.name!r}) is not set"
        )
    return None


# -- parsing ---------------------------------------------------------------


@overload
def _opt(el: etree._Element, name: str, conv: Callable[[str], T]) -> T | None: ...
@overload
def _opt(el: etree._Element, name: str, conv: Callable[[str], T], default: T) -> T: ...
def _opt(
    el: etree._Element, name: str, conv: Callable[[str], T], default: T | None = None
) -> T | None:
    raw = el.get(name)
    if raw is None:
        return default
    try:
        return conv(raw.strip())
    except ValueError as exc:
        raise LlmConfigError(el.sourceline, f"attribute {name}={raw!r}: {exc}") from None


def _positive(conv: Callable[[str], N]) -> Callable[[str], N]:
    def parse(raw: str) -> N:
        value = conv(raw)
        if value <= 0:
            raise ValueError("must be positive")
        return value

    return parse


def _non_negative(conv: Callable[[str], N]) -> Callable[[str], N]:
    def parse(raw: str) -> N:
        value = conv(raw)
        if value < 0:
            raise ValueError("must not be negative")
        return value

    return parse


#: A local backend's context window (llama.cpp's n_ctx) when it declares none.
_LOCAL_N_CTX = 4096


def _boolean(raw: str) -> bool:
    if raw in ("true", "1"):
        return True
    if raw in ("false", "0"):
        return False
    raise ValueError("must be true or false")


def _from_env(el: etree._Element, attr: str, environ: Mapping[str, str]) -> str | None:
    """``attr``, overridden by the environment variable named in ``attr-env`` if set."""
    var = el.get(attr + "-env")
    return (environ.get(var) if var else None) or el.get(attr)


def _backend(el: etree._Element, environ: Mapping[str, str]) -> BackendConfig:
    line = el.sourceline
    name = el.get("name")
    if not name:
        raise LlmConfigError(line, "backend without a name")
    try:
        provider = Provider(el.get("provider", ""))
    except ValueError:
        raise LlmConfigError(
            line, f"backend {name!r}: provider must be one of {[p.value for p in Provider]}"
        ) from None
    base_url = _from_env(el, "base-url", environ)
    model_path = _from_env(el, "model-path", environ)
    if provider is Provider.LLAMA_CPP:
        if not model_path:
            raise LlmConfigError(
                line,
                f"backend {name!r}: provider llama-cpp needs model-path (a GGUF file, or "
                "packaged:smollm2-135m)",
            )
        base_url = base_url or ""
    elif not base_url:
        raise LlmConfigError(line, f"backend {name!r}: base-url is required")
    elif model_path:
        raise LlmConfigError(line, f"backend {name!r}: model-path is for provider llama-cpp only")
    models: list[str] = []
    model_windows: dict[str, int] = {}
    aliases: dict[str, str] = {}
    limits = price = None
    for child in el:
        if not isinstance(child.tag, str):
            continue
        if child.tag == _NS + "model":
            models.append(_from_env(child, "name", environ) or "")
            window = _opt(child, "context-window", _positive(int))
            if window is not None:
                model_windows[models[-1]] = window
        elif child.tag == _NS + "alias":
            aliases[child.get("name", "")] = _from_env(child, "model", environ) or ""
        elif child.tag == _NS + "limits":
            limits = child
        elif child.tag == _NS + "price":
            price = child
    if not models:
        raise LlmConfigError(line, f"backend {name!r} serves no model")
    for alias, target in aliases.items():
        if target not in models:
            raise LlmConfigError(
                line,
                f"backend {name!r}: alias {alias!r} points to {target!r}, not a model it lists",
            )
        if alias in models:
            raise LlmConfigError(line, f"backend {name!r}: alias {alias!r} is also a model name")
    pos_int, pos_seconds = _positive(int), _positive(parse_duration)
    return BackendConfig(
        name=name,
        provider=provider,
        base_url=base_url.rstrip("/"),
        models=tuple(models),
        aliases=aliases,
        api_key_env=el.get("api-key-env") or None,
        # The dataclasses' own defaults (not slotted: their class attributes hold them).
        priority=_opt(el, "priority", int, BackendConfig.priority),
        timeout=_opt(el, "timeout", pos_seconds, BackendConfig.timeout),
        context_window=_opt(el, "context-window", pos_int)
        or (_LOCAL_N_CTX if provider is Provider.LLAMA_CPP else None),
        model_windows=model_windows,
        requests_per_minute=None
        if limits is None
        else _opt(limits, "requests-per-minute", pos_int),
        tokens_per_minute=None if limits is None else _opt(limits, "tokens-per-minute", pos_int),
        max_concurrent=None if limits is None else _opt(limits, "max-concurrent", pos_int),
        price=None
        if price is None
        else Price(
            _opt(price, "input-per-million", _non_negative(float), 0.0),
            _opt(price, "output-per-million", _non_negative(float), 0.0),
        ),
        line=line,
        model_path=model_path,
        threads=_opt(el, "threads", pos_int),
        constrain=_opt(el, "constrain", _boolean, True),
        unless_env=el.get("unless-env") or None,
        temperature=_opt(el, "temperature", _non_negative(float)),
    )


def parse_llm_section(
    element: etree._Element, *, environ: Mapping[str, str] | None = None
) -> RouterConfig:
    """Build a :class:`RouterConfig` from boot.xml's ``<llm>`` element.

    ``environ`` (default ``os.environ``) resolves ``base-url-env`` and ``name-env``
    overrides; API keys are looked up later, by the router.

    Expects a schema-valid element but does not trust it: anything it cannot
    use raises :class:`LlmConfigError` with the source line.
    """
    if element.tag != _NS + "llm":
        raise LlmConfigError(
            element.sourceline, f"expected <llm> in {BOOT_NS}, got {element.tag!s}"
        )
    backends: list[BackendConfig] = []
    retry = RetryConfig()
    breaker = BreakerConfig()
    for child in element:
        if not isinstance(child.tag, str):
            continue
        if child.tag == _NS + "backend":
            backends.append(_backend(child, os.environ if environ is None else environ))
        elif child.tag == _NS + "retry":
            retry = replace(
                retry,
                base_delay=_opt(
                    child, "base-delay", _non_negative(parse_duration), retry.base_delay
                ),
                max_delay=_opt(child, "max-delay", _non_negative(parse_duration), retry.max_delay),
                max_retry_after=_opt(
                    child, "max-retry-after", _non_negative(parse_duration), retry.max_retry_after
                ),
            )
        elif child.tag == _NS + "breaker":
            breaker = BreakerConfig(
                failures=_opt(child, "failures", _positive(int), breaker.failures),
                cooldown=_opt(child, "cooldown", _non_negative(parse_duration), breaker.cooldown),
            )
    seen: dict[str, int | None] = {}
    for b in backends:
        if b.name in seen:
            raise LlmConfigError(
                b.line, f"backend name {b.name!r} already used on line {seen[b.name]}"
            )
        seen[b.name] = b.line
    try:
        strategy = Strategy(element.get("strategy", Strategy.FAILOVER.value))
    except ValueError:
        raise LlmConfigError(
            element.sourceline, f"strategy must be one of {[s.value for s in Strategy]}"
        ) from None
    retry = replace(
        retry, max_attempts=_opt(element, "max-attempts", _positive(int), retry.max_attempts)
    )
    return RouterConfig(
        backends=tuple(backends),
        strategy=strategy,
        retry=retry,
        breaker=breaker,
        timeout=_opt(element, "timeout", _positive(parse_duration), RouterConfig.timeout),
        queue_limit=_opt(element, "queue-limit", _positive(int), RouterConfig.queue_limit),
    )


# -- checking --------------------------------------------------------------

_WRAPPER = f"""<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema"
    xmlns:boot="{BOOT_NS}" targetNamespace="{BOOT_NS}" elementFormDefault="qualified">
  <xs:include schemaLocation="boot-llm.xsd"/>
  <xs:element name="llm" type="boot:LlmSectionType"/>
</xs:schema>"""


def llm_schema() -> etree.XMLSchema:
    """A schema whose root element is ``<llm>``, built around boot-llm.xsd.

    Loaded from the installed package data each call; callers that validate
    often should keep the result.
    """
    resource = files("agentserver.schemas").joinpath("boot-llm.xsd")
    with as_file(resource) as path:
        # The wrapper needs a base URL of its own in the same directory, or
        # libxml2 sees it "including itself".
        base = path.with_name("boot-llm-wrapper.xsd").as_uri()
        doc = etree.fromstring(_WRAPPER.encode(), base_url=base)
        return etree.XMLSchema(doc)


def check_llm_section(
    element: etree._Element,
    *,
    environ: Mapping[str, str] | None = None,
    validate: bool = True,
) -> LlmCheck:
    """What ``agentserver check`` reports about an ``<llm>`` section.

    Errors make the section unusable (schema violations, duplicate names, ...);
    warnings point at things that will bite at run time: an API key variable
    that is unset (that backend is skipped when the router starts), an alias
    that shadows another backend's model name, a context overflow that can
    never fail over because a window is unknown. ``validate=False`` skips the
    schema when the caller has already validated the whole document. Without errors the
    result carries the parsed :class:`RouterConfig` (``environ`` resolved its ``*-env``
    overrides; API keys stay variable names, read by the router when it starts).
    """
    env = os.environ if environ is None else environ
    errors: list[tuple[int, str]] = []
    warnings: list[tuple[int, str]] = []
    if validate:
        schema = llm_schema()
        if not schema.validate(element):
            for e in schema.error_log:
                errors.append((e.line, e.message))
            return LlmCheck(errors, warnings)
    try:
        config = parse_llm_section(element, environ=env)
    except LlmConfigError as exc:
        errors.append((exc.line or element.sourceline or 0, exc.message))
        return LlmCheck(errors, warnings)

    line_of = {b.name: b.line or element.sourceline or 0 for b in config.backends}
    for b in config.backends:
        if b.provider is Provider.LLAMA_CPP and b.model_path and not missing_key_reason(b, env):
            # A model that cannot load is a configuration error now, not a failed Turn later.
            from .local_models import LocalModelError, check_loads

            try:
                check_loads(b.model_path)
            except LocalModelError as exc:
                aside = (
                    f" (or set {b.unless_env}: this backend then stands aside)"
                    if b.unless_env
                    else ""
                )
                errors.append((line_of[b.name], f"backend {b.name!r}: {exc}{aside}"))
    if errors:
        return LlmCheck(errors, warnings)
    runnable = []
    for b in config.backends:
        reason = missing_key_reason(b, env)
        if b.unless_env and env.get(b.unless_env):
            pass  # standing aside as configured: nothing to warn about
        elif reason:
            warnings.append((line_of[b.name], f"{reason}; the backend will be skipped"))
        else:
            runnable.append(b)
        if b.provider is Provider.ANTHROPIC and not b.api_key_env:
            warnings.append(
                (line_of[b.name], f"backend {b.name!r}: Anthropic needs an API key (api-key-env)")
            )
    if config.backends and not runnable:
        warnings.append(
            (element.sourceline or 0, "no backend can run: every API key variable is unset")
        )
    served: dict[str, list[BackendConfig]] = {}
    for b in config.backends:
        for m in b.models:
            served.setdefault(m, []).append(b)
    for b in config.backends:
        for alias, target in b.aliases.items():
            for other in served.get(alias, ()):
                if other is not b:
                    warnings.append(
                        (
                            line_of[b.name],
                            f"backend {b.name!r}: alias {alias!r} (for {target!r}) is a model "
                            f"name on backend {other.name!r}; requests for it go to both",
                        )
                    )
    for model, group in served.items():
        if len(group) > 1 and any(b.context_window is None for b in group):
            names = ", ".join(b.name for b in group if b.context_window is None)
            warnings.append(
                (
                    line_of[group[0].name],
                    f"model {model!r}: context-window unknown on {names}; a context "
                    "overflow there cannot fail over",
                )
            )
    return LlmCheck(errors, warnings, config)

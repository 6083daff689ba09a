"""What loading boot.xml finds: :class:`Problem`, :class:`LoadResult`, :class:`BootError`,
and :class:`Report`, where each section's reader adds the problems it finds."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentserver.config.topology import Topology
from agentserver.core.errors import ConfigurationError
from agentserver.core.namespaces import BOOT_NS, CORE_NS


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding, printed as ``FILE:LINE: message`` (warnings say so)."""

    path: str
    line: int
    message: str
    warning: bool = False

    def __str__(self) -> str:
        kind = "warning: " if self.warning else ""
        return f"{self.path}:{self.line}: {kind}{self.message}"


@dataclass(slots=True)
class LoadResult:
    """The topology (None if any error was found) and every problem, in file order."""

    topology: Topology | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if not p.warning]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.warning]

    @property
    def ok(self) -> bool:
        return self.topology is not None


class BootError(ConfigurationError):
    """boot.xml has errors; ``problems`` lists them all."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


class Report:
    """The problems found so far in one file (shown under the name ``shown``)."""

    def __init__(self, shown: str) -> None:
        self.shown = shown
        self.problems: list[Problem] = []

    def error(self, line: int | None, message: str) -> None:
        self.problems.append(Problem(self.shown, line or 0, message))

    def warn(self, line: int | None, message: str) -> None:
        self.problems.append(Problem(self.shown, line or 0, message, warning=True))

    @property
    def failed(self) -> bool:
        return any(not p.warning for p in self.problems)

    def result(self, topology: Topology | None) -> LoadResult:
        """The result: ``topology`` only if no error was reported; problems in line order."""
        self.problems.sort(key=lambda p: p.line)
        return LoadResult(None if self.failed else topology, self.problems)


def pretty(message: str) -> str:
    """A schema or checker message for people: the boot namespace is implied, the core
    namespace is ``core:`` (messages name elements in Clark notation)."""
    return message.replace(f"{{{BOOT_NS}}}", "").replace(f"{{{CORE_NS}}}", "core:")

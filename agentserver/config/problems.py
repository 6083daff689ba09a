"""What loading boot.xml finds: :class:`Problem`, :class:`LoadResult`, :class:`BootError`,
and :class:`Report`, where each section's reader adds the problems it finds."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from agentserver.config.topology import Topology
from agentserver.core.errors import ConfigurationError
from agentserver.core.namespaces import BOOT_NS, CORE_NS


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding, printed as ``FILE:LINE: message`` (warnings say so), then its
    ``notes``, one indented line each: the knock-on effects it has (a peer, a budget, a
    schedule naming what failed), said under it instead of as errors of their own."""

    path: str
    line: int
    message: str
    warning: bool = False
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        kind = "warning: " if self.warning else ""
        return f"{self.path}:{self.line}: {kind}{self.message}" + "".join(
            f"\n    {note}" for note in self.notes
        )


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

    def error(self, line: int | None, message: str) -> Problem:
        problem = Problem(self.shown, line or 0, message)
        self.problems.append(problem)
        return problem

    def warn(self, line: int | None, message: str) -> Problem:
        problem = Problem(self.shown, line or 0, message, warning=True)
        self.problems.append(problem)
        return problem

    def note(self, cause: Problem, text: str) -> None:
        """Say ``text`` (a knock-on effect of ``cause``) under ``cause``, not as a problem
        of its own: the one error a user has to fix is the cause."""
        for i, problem in enumerate(self.problems):
            # ``cause`` as reported: an earlier note replaced it with a copy.
            if (problem.line, problem.message, problem.warning) == (
                cause.line,
                cause.message,
                cause.warning,
            ):
                self.problems[i] = replace(problem, notes=(*problem.notes, text))
                return
        raise ValueError(f"not a problem of this report: {cause}")

    def first_error_since(self, count: int) -> Problem | None:
        """The first error reported after the first ``count`` problems, or None."""
        return next((p for p in self.problems[count:] if not p.warning), None)

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

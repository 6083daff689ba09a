"""boot.xml's ``<budget>`` elements read into :class:`BudgetSpec` (docs/budgets.md): the
organism's (a child of ``<organism>``), each agent's (inside its ``<agent>``), each named
client's (inside its ``<client>``, across agents or with ``agent="NAME"`` on one)."""

from __future__ import annotations

from collections.abc import Callable, Collection

from lxml import etree

from agentserver.agents.policy.budget import BudgetSpec, budget_name, parse_soft
from agentserver.config.imports import B
from agentserver.config.problems import Problem, Report

__all__ = ["fair_weights", "read_budgets"]


def fair_weights(root: etree._Element) -> tuple[tuple[str, float], ...] | None:
    """``<store fair-share="true">``: each named client's ``weight`` (1 unless given);
    None when fair share is off."""
    store = root.find(B + "store")
    if store is None or store.get("fair-share") not in ("true", "1"):
        return None
    return tuple(
        (c.get("name", ""), float(c.get("weight", "1")))
        for c in root.iterfind(f"{B}clients/{B}client")
    )


def read_budgets(
    report: Report,
    root: etree._Element,
    agents: Collection[str],
    cause_of: Callable[[str], Problem | None] = lambda name: None,
) -> tuple[BudgetSpec, ...]:
    """Every declared budget, checked (a problem per bad one, by line; none kept then).
    ``cause_of(name)``: the error that made a declared listener fail; a budget naming it
    is said under that error, not as one of its own."""
    found: list[BudgetSpec] = []
    seen: set[str] = set()

    def add(el: etree._Element, name: str) -> None:
        if name in seen:
            report.error(el.sourceline, f"budget {name} is declared twice")
            return
        seen.add(name)
        try:
            found.append(spec_of(el, name))
        except ValueError as exc:
            report.error(el.sourceline, f"<budget> of {name}: {exc}")

    el = root.find(B + "budget")
    if el is not None:
        if el.get("agent"):
            report.error(el.sourceline, 'agent="..." belongs on a client\'s <budget> only')
        add(el, budget_name())
    for listener in root.iterfind(f"{B}listeners/{B}listener"):
        el = listener.find(f"{B}agent/{B}budget")
        if el is not None:
            if el.get("agent"):
                report.error(el.sourceline, 'agent="..." belongs on a client\'s <budget> only')
            add(el, budget_name(agent=listener.get("name", "")))
    for client in root.iterfind(f"{B}clients/{B}client"):
        for el in client.iterfind(B + "budget"):
            agent = el.get("agent")
            if agent is not None and agent not in agents:
                if (cause := cause_of(agent)) is not None:
                    report.note(
                        cause,
                        f"(so <budget agent={agent!r}>, line {el.sourceline}, has no agent)",
                    )
                else:
                    report.error(el.sourceline, f"<budget agent={agent!r}>: no agent of that name")
                continue
            add(el, budget_name(client=client.get("name", ""), agent=agent))
    return tuple(found)


def spec_of(el: etree._Element, name: str) -> BudgetSpec:
    """One ``<budget>`` element as the spec of ``name`` (ValueError: what is wrong)."""
    tokens = el.get("tokens")
    cost = el.get("cost")
    soft = el.get("soft")
    return BudgetSpec(
        name=name,
        tokens=int(tokens) if tokens else None,
        cost=float(cost) if cost else None,
        period=el.get("period", "month"),
        soft=parse_soft(soft) if soft else None,
        timezone=el.get("timezone", "UTC"),
        line=el.sourceline or 0,
    )

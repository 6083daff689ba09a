"""``GET /v1/budgets``, ``GET/PUT /v1/budgets/{name}``, ``POST /v1/budgets/{name}/reset``:
the spend budgets read and changed at run time (docs/budgets.md).

Operators (the clients boot.xml marks ``operator``; anonymous loopback callers when no
client is declared) see every budget and may change them; any other caller sees only its
own client budgets and changes nothing. A change applies to this process's reservations
at once and to the store's current period row (which every process checks against).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserver.agents.policy.budget import BudgetSpec, parse_soft, valid_name
from agentserver.agents.store.sql.budgets import SpendRow
from agentserver.core.handshake import Identity
from agentserver.http.context import HttpContext
from agentserver.http.gate import Gate
from agentserver.http.problems import problem

#: The most bytes of a PUT body.
MAX_BODY = 4096


def row_json(row: SpendRow) -> dict[str, Any]:
    """One budget's current period as the API shows it."""
    tokens_left, cost_left = row.remaining()
    return {
        "budget": row.budget,
        "period": row.period,
        "period_start": row.period_start,
        "resets_at": None if math.isinf(row.period_end) else row.period_end,
        "resets": "never"
        if math.isinf(row.period_end)
        else dt.datetime.fromtimestamp(row.period_end, dt.UTC).isoformat(),
        "limit": {"tokens": row.limit_tokens, "cost": row.limit_cost},
        "soft": row.soft,
        "spent": {"tokens": row.spent_tokens, "cost": row.spent_cost},
        "reserved": {"tokens": row.reserved_tokens, "cost": row.reserved_cost},
        "remaining": {"tokens": tokens_left, "cost": cost_left},
        "used": round(row.used(), 4),
        "refusals": row.refusals,
        "soft_reached_at": row.soft_at,
    }


def is_budget_operator(ctx: HttpContext, identity: Identity) -> bool:
    """Whether ``identity`` may see every budget and change them (the authorization
    rule's operator)."""
    assert ctx.access is not None
    return ctx.access.sees_all(identity.name)


def budget_owner(budget: str) -> str | None:
    """The client a budget is of (``client:NAME`` and ``client:NAME@agent:A``), None for
    the organism's and an agent's."""
    kind, _, rest = budget.partition(":")
    return rest.partition("@")[0] or None if kind == "client" else None


def may_see_budget(ctx: HttpContext, identity: Identity, budget: str) -> bool:
    """Operators see every budget; a client its own."""
    assert ctx.access is not None
    return ctx.access.decide(identity.name, budget_owner(budget))


async def visible_budgets(ctx: HttpContext, identity: Identity) -> list[dict[str, Any]]:
    """The budgets ``identity`` may see, as the API shows them."""
    if ctx.budgets is None:
        return []
    rows = await ctx.budgets.rows()
    return [row_json(r) for r in rows if may_see_budget(ctx, identity, r.budget)]


class BudgetRoutes:
    def __init__(self, ctx: HttpContext, gate: Gate) -> None:
        self.ctx = ctx
        self.gate = gate

    def _operator(self, identity: Identity) -> bool:
        return is_budget_operator(self.ctx, identity)

    def _may_see(self, identity: Identity, budget: str) -> bool:
        return may_see_budget(self.ctx, identity, budget)

    async def list(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        return JSONResponse({"budgets": await visible_budgets(self.ctx, identity)})

    async def one(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        name = request.path_params["name"]
        budgets = self.ctx.budgets
        if budgets is not None:
            for row in await budgets.rows():
                if row.budget == name and self.gate.owns(identity, budget_owner(name), request):
                    return JSONResponse(row_json(row))
        # Another client's budget answers as a missing one (docs/security.md).
        return problem(404, "not-found", f"No budget {name!r}.")

    async def put(self, request: Request) -> Response:
        """Declare or change a budget: a JSON object with ``tokens``, ``cost``, ``period``,
        ``soft`` (``"80%"``) and ``timezone``; omitted keys keep their current values (a
        new budget: their defaults). ``null`` lifts a limit (one must remain)."""
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        budgets = self.ctx.budgets
        if budgets is None:
            return problem(409, "no-agents", "This server runs no agents.")
        if not self._operator(identity):
            self.gate.refuse(identity, request)
            return problem(403, "forbidden", "Only an operator may change budgets.")
        name = request.path_params["name"]
        if not valid_name(name):
            return problem(
                400,
                "bad-request",
                "A budget is named organism, agent:NAME, client:NAME or client:NAME@agent:NAME.",
            )
        body = await request.body()
        try:
            if len(body) > MAX_BODY:
                raise ValueError(f"the body exceeds {MAX_BODY} bytes")
            changes = json.loads(body or b"{}")
            if not isinstance(changes, dict):
                raise ValueError("the body is a JSON object")
            spec = merged(budgets.specs.get(name), name, changes)
        except ValueError as exc:
            return problem(400, "bad-request", f"Budget not changed: {exc}")
        await budgets.set(spec)
        for row in await budgets.rows():
            if row.budget == name:
                return JSONResponse(row_json(row))
        return problem(500, "internal", "The budget was set but cannot be read.")

    async def reset(self, request: Request) -> Response:
        identity = await self.gate.identify(request)
        if isinstance(identity, Response):
            return identity
        budgets = self.ctx.budgets
        name = request.path_params["name"]
        if not self._operator(identity):
            # Before the name is looked up: the same answer whether it exists or not.
            self.gate.refuse(identity, request)
            return problem(403, "forbidden", "Only an operator may reset budgets.")
        if budgets is None or name not in budgets.specs:
            return problem(404, "not-found", f"No budget {name!r}.")
        await budgets.reset(name)
        for row in await budgets.rows():
            if row.budget == name:
                return JSONResponse(row_json(row))
        return problem(500, "internal", "The budget was reset but cannot be read.")


_KEYS = {"tokens", "cost", "period", "soft", "timezone"}


def merged(old: BudgetSpec | None, name: str, changes: dict[str, Any]) -> BudgetSpec:
    """``old`` (or a new spec of ``name``) with ``changes`` applied; ValueError if bad."""
    unknown = set(changes) - _KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    base: dict[str, Any] = {
        "tokens": old.tokens if old else None,
        "cost": old.cost if old else None,
        "period": old.period if old else "month",
        "soft": old.soft if old else None,
        "timezone": old.timezone if old else "UTC",
    }
    for key, value in changes.items():
        if (
            key == "tokens"
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int))
        ):
            raise ValueError("tokens is an integer")
        if (
            key == "cost"
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int | float))
        ):
            raise ValueError("cost is a number")
        if key in ("period", "timezone") and not isinstance(value, str):
            raise ValueError(f"{key} is a string")
        if key == "soft" and value is not None:
            if not isinstance(value, str):
                raise ValueError('soft is a percentage string like "80%"')
            value = parse_soft(value)
        base[key] = float(value) if key == "cost" and value is not None else value
    return BudgetSpec(name=name, **base)

"""The ``calculator`` listener: integer arithmetic, one operation per payload.

Each request is answered on the caller's thread:

- ``<add><a/><b/></add>`` → ``<sum><value>a+b</value></sum>``
- ``<subtract><a/><b/></subtract>`` → ``<difference><value>a-b</value></difference>``
- ``<multiply><a/><b/></multiply>`` → ``<product><value>a*b</value></product>``
- ``<divide><a/><b/></divide>`` → ``<quotient><value>a//b</value><remainder>a%b</remainder>
  </quotient>`` (floor division)

A request that has no result (dividing by zero, a result outside ``xs:long``) is answered
with ``<error status="failed"><code>division-by-zero|overflow</code><message>…</message>
</error>``: an answer the caller can read (``agentserver send`` exits 1 for it), not a
handler failure.

All in namespace ``urn:agentserver:calculator``. Operands and results are bounded to 64-bit
signed integers (``xs:long``) so a request cannot make the server build enormous numbers.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic_xml import BaseXmlModel, attr, element

from agentserver.core.listener import HandlerMetadata, HandlerResponse
from agentserver.core.xsdgen import XsdType

NS = "urn:agentserver:calculator"
_NSMAP = {"": NS}
Long = Annotated[int, XsdType("xs:long")]
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


class CalculationOverflow(ArithmeticError):
    """A result does not fit in ``xs:long``."""


class Add(BaseXmlModel, tag="add", nsmap=_NSMAP):
    a: Long = element()
    b: Long = element()


class Subtract(BaseXmlModel, tag="subtract", nsmap=_NSMAP):
    a: Long = element()
    b: Long = element()


class Multiply(BaseXmlModel, tag="multiply", nsmap=_NSMAP):
    a: Long = element()
    b: Long = element()


class Divide(BaseXmlModel, tag="divide", nsmap=_NSMAP):
    a: Long = element()
    b: Long = element()


class Sum(BaseXmlModel, tag="sum", nsmap=_NSMAP):
    value: Long = element()


class Difference(BaseXmlModel, tag="difference", nsmap=_NSMAP):
    value: Long = element()


class Product(BaseXmlModel, tag="product", nsmap=_NSMAP):
    value: Long = element()


class Quotient(BaseXmlModel, tag="quotient", nsmap=_NSMAP):
    value: Long = element()
    remainder: Long = element()


class CalculatorError(BaseXmlModel, tag="error", nsmap=_NSMAP):
    """The request has no result. ``status="failed"`` is the project's mark of a failed
    answer; ``code`` is for programs, ``message`` for people."""

    status: Literal["failed"] = attr(default="failed")
    code: Literal["division-by-zero", "overflow"] = element()
    message: str = element()


REQUESTS = (Add, Subtract, Multiply, Divide)
RESULTS = (Sum, Difference, Product, Quotient, CalculatorError)


def _checked(value: int) -> int:
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise CalculationOverflow(value)
    return value


def calculate(payload: Add | Subtract | Multiply | Divide) -> BaseXmlModel:
    """The result payload of one request. Raises ``ZeroDivisionError`` or
    :class:`CalculationOverflow` when there is none (:func:`answer` turns them into a
    :class:`CalculatorError`)."""
    a, b = payload.a, payload.b
    if isinstance(payload, Add):
        return Sum(value=_checked(a + b))
    if isinstance(payload, Subtract):
        return Difference(value=_checked(a - b))
    if isinstance(payload, Multiply):
        return Product(value=_checked(a * b))
    if isinstance(payload, Divide):
        q, r = divmod(a, b)
        return Quotient(value=_checked(q), remainder=r)
    raise TypeError(f"not a calculator request: {type(payload).__name__}")


def answer(payload: Add | Subtract | Multiply | Divide) -> BaseXmlModel:
    """The result of one request, or the :class:`CalculatorError` saying why there is none."""
    try:
        return calculate(payload)
    except ZeroDivisionError:
        return CalculatorError(
            code="division-by-zero", message=f"cannot divide {payload.a} by zero"
        )
    except CalculationOverflow:
        return CalculatorError(
            code="overflow",
            message=f"the result does not fit in a 64-bit signed integer ({_LONG_MIN} to "
            f"{_LONG_MAX})",
        )


async def handle(
    payload: Add | Subtract | Multiply | Divide, meta: HandlerMetadata
) -> HandlerResponse:
    """Answer the caller with the result (or the error)."""
    return HandlerResponse.respond(answer(payload))

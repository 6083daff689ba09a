"""A unit converter with its own schema: a decimal value, a unit from a fixed set, an
optional precision, and a list in the answer (every step of the conversion)."""

from decimal import Decimal
from typing import Literal

from pydantic_xml import BaseXmlModel, attr, element

from agentserver.listener import HandlerMetadata, HandlerResponse

NSMAP = {"": "urn:example:units"}

Unit = Literal["mm", "cm", "m", "km", "in", "ft", "mi"]

#: Metres per unit.
METRES = {
    "mm": Decimal("0.001"),
    "cm": Decimal("0.01"),
    "m": Decimal(1),
    "km": Decimal(1000),
    "in": Decimal("0.0254"),
    "ft": Decimal("0.3048"),
    "mi": Decimal("1609.344"),
}


class Convert(BaseXmlModel, tag="convert", nsmap=NSMAP):
    value: Decimal = element()
    # XML names with a dash are spelled out; Python names stay snake_case.
    from_unit: Unit = element(tag="from")
    to_unit: Unit = element(tag="to")
    # Optional: absent from the XML means None (the XSD says minOccurs="0").
    places: int | None = element(default=None)


class Step(BaseXmlModel, tag="step", nsmap=NSMAP):
    unit: Unit = attr()
    value: Decimal


class Converted(BaseXmlModel, tag="converted", nsmap=NSMAP):
    value: Decimal = element()
    unit: Unit = element()
    steps: list[Step] = element(tag="step", default_factory=list)


async def convert(payload: Convert, meta: HandlerMetadata) -> HandlerResponse:
    metres = payload.value * METRES[payload.from_unit]
    result = metres / METRES[payload.to_unit]
    if payload.places is not None:
        result = round(result, payload.places)
    steps = [
        Step(unit=payload.from_unit, value=payload.value),
        Step(unit="m", value=metres),
        Step(unit=payload.to_unit, value=result),
    ]
    return HandlerResponse.respond(Converted(value=result, unit=payload.to_unit, steps=steps))

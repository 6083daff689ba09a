"""A two-listener forward chain: ``orders`` takes an order, asks its peer ``pricing`` for
the price, and answers its caller with a quote.

client --order--> orders --price-request--> pricing
client <--quote-- orders <------price------ pricing
"""

from pydantic_xml import BaseXmlModel, element

from agentserver.listener import HandlerMetadata, HandlerResponse

NSMAP = {"": "urn:example:shop"}

#: Price list, in cents.
PRICES = {"apple": 50, "pear": 65, "melon": 300}


class Order(BaseXmlModel, tag="order", nsmap=NSMAP):
    item: str = element()
    quantity: int = element()


class PriceRequest(BaseXmlModel, tag="price-request", nsmap=NSMAP):
    item: str = element()
    quantity: int = element()


class Price(BaseXmlModel, tag="price", nsmap=NSMAP):
    item: str = element()
    quantity: int = element()
    unit_cents: int = element(tag="unit-cents")


class Quote(BaseXmlModel, tag="quote", nsmap=NSMAP):
    item: str = element()
    quantity: int = element()
    total_cents: int = element(tag="total-cents")


class Unavailable(BaseXmlModel, tag="unavailable", nsmap=NSMAP):
    item: str = element()


async def orders(payload: Order | Price | Unavailable, meta: HandlerMetadata) -> HandlerResponse:
    if isinstance(payload, Order):
        # Forward: what the answer will need (the quantity) travels with the request,
        # so this handler keeps no state between the two calls.
        request = PriceRequest(item=payload.item, quantity=payload.quantity)
        return HandlerResponse(request, to="pricing")
    if isinstance(payload, Unavailable):
        return HandlerResponse.respond(payload)
    total = payload.unit_cents * payload.quantity
    return HandlerResponse.respond(
        Quote(item=payload.item, quantity=payload.quantity, total_cents=total)
    )


async def pricing(payload: PriceRequest, meta: HandlerMetadata) -> HandlerResponse:
    cents = PRICES.get(payload.item)
    if cents is None:
        return HandlerResponse.respond(Unavailable(item=payload.item))
    return HandlerResponse.respond(
        Price(item=payload.item, quantity=payload.quantity, unit_cents=cents)
    )

"""XML namespaces of the wire contract. These strings are part of the protocol: never change them."""

from typing import Final

ENVELOPE_NS: Final = "https://xml-pipeline.org/ns/envelope/v1"
CORE_NS: Final = "https://xml-pipeline.org/ns/core/v1"
BOOT_NS: Final = "https://xml-pipeline.org/ns/boot/v1"
XSD_NS: Final = "http://www.w3.org/2001/XMLSchema"


def clark(ns: str, local: str) -> str:
    """Return the ``{namespace}local`` (Clark notation) tag lxml uses."""
    return f"{{{ns}}}{local}" if ns else local

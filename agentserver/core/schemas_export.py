"""Write the generated XSDs to ``schemas/`` so clients can validate what they send.

Usage: ``python -m agentserver.core.schemas_export [DIR]`` (default: the ``schemas`` directory of
this checkout). ``core.xsd`` is generated from :mod:`agentserver.primitives.core`; payload
schemas of a topology are exported with ``agentserver schemas`` once a boot file exists.
"""

from __future__ import annotations

import importlib.resources
import pathlib
import sys

from lxml import etree

from agentserver.core.xsdgen import derive_schema, merge_schemas
from agentserver.primitives.core import CORE_MODELS


def core_xsd_bytes() -> bytes:
    doc = merge_schemas([derive_schema(m) for m in CORE_MODELS])
    return etree.tostring(doc, pretty_print=True, xml_declaration=True, encoding="UTF-8")


def schema_path(name: str) -> pathlib.Path:
    """Path of a bundled schema file (works for editable and regular installs)."""
    return pathlib.Path(str(importlib.resources.files("agentserver.schemas").joinpath(name)))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = pathlib.Path(args[0]) if args else schema_path("core.xsd").parent
    out = target / "core.xsd"
    out.write_bytes(core_xsd_bytes())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The built-in ``submit_result`` tool (not routed through the pump).

The model ends its Turn with named fields::

    <submit_result>
      <field name="summary">...</field>
      <total>42</total>            <!-- a child named after the field works too -->
    </submit_result>

Validation is minimal and never rejects (seed 000: availability first): missing required
fields, unknown fields and duplicates are reported as warnings and the result is marked
``degraded``. Once per Turn: the worker refuses a second call with a ``<huh>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lxml import etree

from agentserver.agents.profile.agent import SUBMIT_RESULT, ResultField


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    fields: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]

    @property
    def degraded(self) -> bool:
        return bool(self.warnings)

    def as_text(self) -> str:
        """The deliverable text: one ``name: value`` line per field, in submitted order."""
        return "\n".join(f"{name}: {value}" for name, value in self.fields)


def usage_text(fields: tuple[ResultField, ...]) -> str:
    """Instructions for the model, appended to the system prompt."""
    lines = [
        f"To finish with a structured result, write one <{SUBMIT_RESULT}> element "
        '(at most once per task) with one <field name="..."> child per field.'
    ]
    for f in fields:
        need = "required" if f.required else "optional"
        lines.append(f"- {f.name} ({need}){': ' + f.description if f.description else ''}")
    # The payload finder refuses any other element written as markup (parsing.py).
    lines.append(
        "Any other XML element you write is taken as something you try to send; to show "
        "markup as text, put it in backticks."
    )
    return "\n".join(lines)


def evaluate_submit(element: etree._Element, declared: tuple[ResultField, ...]) -> SubmitOutcome:
    """Read the fields of a ``submit_result`` element and check them against ``declared``."""
    got: list[tuple[str, str]] = []
    warnings: list[str] = []
    seen: set[str] = set()
    for child in element:
        if not isinstance(child.tag, str):
            continue
        local = etree.QName(child).localname
        name = child.get("name", "") if local == "field" else local
        value = "".join(child.itertext()).strip()
        if not name:
            warnings.append("a <field> without a name was ignored")
            continue
        if name in seen:
            warnings.append(f"field {name!r} given twice; the first is kept")
            continue
        seen.add(name)
        got.append((name, value))
    if not got and (element.text or "").strip():
        got.append(("result", (element.text or "").strip()))
    names = {f.name for f in declared}
    for f in declared:
        if f.required and f.name not in seen:
            warnings.append(f"required field {f.name!r} is missing")
    if declared:
        warnings += [f"field {n!r} was not declared" for n, _ in got if n not in names]
    return SubmitOutcome(tuple(got), tuple(warnings))

"""The settings references of docs/configuration.md, drawn from the pydantic models that validate the settings.

Each setting's default and meaning come from its ``Field`` (a test checks that the page holds these tables), so a
setting added, renamed or redescribed in the code cannot leave the page behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def default_text(field: FieldInfo) -> str:
    """A field's default as the tables write it: ``required``, ``unset`` (None), or the value."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, (str, list, dict)) else str(value)


def meaning(field: FieldInfo) -> str:
    """A field's description, plus its choices when it is a Literal."""
    text = field.description or ""
    choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
    if choices:
        text += " One of " + ", ".join(f"`{choice}`" for choice in choices) + "."
    return text


def settings_table(model: type[BaseModel]) -> str:
    """Every setting of ``model`` as a markdown table, nested sections flattened to dotted keys: a section's own
    row first (its default reads "section"), then its settings; a mapping or list of sections names its item
    ``<name>`` or ``[]``. A section type met again (``model_limits`` repeats ``limits``) gets its own row only."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {text} |" for key, default, text in _rows(model, "", set())]
    return "\n".join(lines)


def _rows(model: type[BaseModel], prefix: str, seen: set[type[BaseModel]]) -> Iterator[tuple[str, str, str]]:
    seen.add(model)
    for name, field in model.model_fields.items():
        key = prefix + name
        section, item = _section_of(field.annotation)
        if section is None or section in seen:
            yield key, default_text(field), meaning(field)
            continue
        yield key, "section" if item == "" else default_text(field), meaning(field)
        yield from _rows(section, f"{key}{item}.", seen)


def _section_of(annotation: object) -> tuple[type[BaseModel] | None, str]:
    """The settings model a field holds, and how its keys are reached: directly (``""``), as the values of a
    mapping (``".<name>"``) or as the items of a list (``"[]"``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = get_origin(annotation), get_args(annotation)
    inner = args[-1] if origin in (dict, list) and args else None
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return inner, ".<name>" if origin is dict else "[]"
    return None, ""

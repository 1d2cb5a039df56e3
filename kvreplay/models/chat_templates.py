"""Chat templates given instead of a model's own (`EngineConfig.chat_template`): a Jinja file, or
the name of one shipped here (`templates/<name>.jinja`), such as `chatml-tools`, which renders
OpenAI tools for ChatML models (SmolLM2's own template renders none)."""
from __future__ import annotations

from pathlib import Path

import jinja2

SHIPPED = Path(__file__).with_name("templates")


def shipped_names() -> list[str]:
    return sorted(path.stem for path in SHIPPED.glob("*.jinja"))


def read_chat_template(value: str) -> str:
    """The template text of a shipped name or a file path; ValueError naming what is wrong (no
    such file, not Jinja)."""
    path = SHIPPED / f"{value}.jinja" if value in shipped_names() else Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {value!r} is neither a file nor a shipped template "
                         f"({', '.join(shipped_names())})")
    text = path.read_text(encoding="utf-8")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template {value!r} is not a Jinja template: line {exc.lineno}: "
                         f"{exc.message}") from None
    return text

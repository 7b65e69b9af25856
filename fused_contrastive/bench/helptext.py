"""Plain-text ``--help`` descriptions from the sub-commands' module docstrings."""

from __future__ import annotations

import re


def help_text(doc: str) -> str:
    """The first paragraph of a module docstring as plain text: without the leading
    ``python -m fused_contrastive <command>:`` (the usage line shows the command) and without reST
    markup (double backquotes and ``:role:`` references reduced to their text)."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = re.sub(r"^``python -m fused_contrastive [\w-]+``:\s*", "", text)
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    text = text.replace("``", "")
    return text[:1].upper() + text[1:]

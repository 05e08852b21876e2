"""mkdocs hook: the Sphinx roles of refit's docstrings (``:class:`~refit_core.x.Name` ``) render as code.

mkdocstrings keeps a role's text as it is (``:class:<code>~refit_core.x.Name</code>``); this drops the role
and, as Sphinx does for ``~``, keeps the last dotted part.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj|const|py:\w+):<code>(~?)([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **_: object) -> str:
    return ROLE.sub(_code, html)

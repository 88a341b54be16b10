"""Jinja2 templates of what selfcest writes for people to read: the trace viewer's page
(``trace.html.j2``, autoescaped) and the CPU reproduction's ``report.md`` (``repro_report.md.j2``,
plain text).

The templates ship as package data beside this module. Both environments are strict: a name
a template uses but the caller did not pass is an error, not an empty string, so a renamed
field cannot silently drop a number from a report. Data is only ever passed to a template,
never compiled as one: model text such as ``{{ 7*7 }}`` is printed as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import jinja2


def environment(*, html: bool, finalize: Callable[[object], object]
                | None = None) -> jinja2.Environment:
    """An environment over this package's templates.

    ``html``: autoescape every printed value (for HTML; Markdown is text and stays
    unescaped). ``finalize``: applied to every printed value before escaping. Block tags
    leave no blank lines or indentation behind (``trim_blocks``, ``lstrip_blocks``), and a
    template's final newline is kept, so the output's layout is the template's.
    """
    return jinja2.Environment(
        loader=jinja2.PackageLoader(__name__, "."),
        autoescape=html,
        finalize=finalize,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )

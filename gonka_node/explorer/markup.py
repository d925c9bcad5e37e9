"""HTML (and SVG) built from Python values, escaped by construction.

`el(tag, *children, **attrs)` escapes every text child and every attribute value; only `Markup`
(what `el` itself returns, or the page's fixed strings wrapped on purpose) passes through unescaped.
There is no other way to put text into a page, so a string from a chain event or an aggregator (an
address, a reason, a proposal's description, an evidence URI) always renders as text.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import cast

VOID = frozenset({"br", "hr", "img", "link", "meta", "input", "circle", "line", "rect", "path", "polyline"})


class Markup(str):
    """Text that is already HTML."""

    __slots__ = ()


def escape(value: object) -> Markup:
    if isinstance(value, Markup):
        return value
    return Markup(html.escape(str(value), quote=True))


def _children(children: Iterable[object]) -> Iterable[Markup]:
    for child in children:
        if child is None or child is False:
            continue
        if isinstance(child, str | int | float):
            yield escape(child)
        else:
            yield from _children(cast(Iterable[object], child))  # anything else is a nested list of children


def _safe_url(url: str) -> bool:
    """A path on this server or a fragment: the pages link nowhere else."""
    return (url.startswith("/") and not url.startswith("//") and "\\" not in url) or url.startswith("#")


def _attr(name: str, value: object) -> str:
    key = name.rstrip("_").replace("_", "-")
    if value is True:
        return f" {key}"
    if key in ("href", "src") and not _safe_url(str(value)):
        value = "#"  # never a javascript:/data: URL, nor another host's, built from untrusted input
    return f' {key}="{escape(value)}"'


def el(tag: str, *children: object, **attrs: object) -> Markup:
    """<tag attrs>children</tag>; `class_` → class, `data_x` → data-x; None/False attributes are left out."""
    opened = "".join(_attr(k, v) for k, v in attrs.items() if v is not None and v is not False)
    if tag in VOID and not children:
        return Markup(f"<{tag}{opened}>" if tag in ("br", "hr", "img", "link", "meta", "input") else f"<{tag}{opened}/>")
    return Markup(f"<{tag}{opened}>{''.join(_children(children))}</{tag}>")


def join(parts: Iterable[object]) -> Markup:
    return Markup("".join(_children(parts)))

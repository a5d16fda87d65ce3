"""Griffe extension for the documentation site: render the docstrings' reST markup as Markdown.

The docstrings mix Google-style sections (``Args:``) with Sphinx roles and directives. mkdocstrings renders
Markdown, so before the docstrings are parsed this extension rewrites, in the text only (the source is untouched):

* ``:class:`~a.b.C``` (and ``:meth:``, ``:func:``, ``:attr:``, ``:mod:``, ``:data:``, ``:exc:``, ``:obj:``) into an
  optional cross-reference: a link where the object is rendered on the site, plain code where it is not (so a
  reference to a private helper never fails ``mkdocs build --strict``);
* ``:math:`x``` into ``\\(x\\)`` and ``.. math::`` blocks into ``$$ ... $$`` blocks (``pymdownx.arithmatex``);
* a paragraph ending in ``::`` (a reST literal block follows) into one ending in ``:``;
* an ``Args:`` entry whose names run over two lines (``a, b,`` / ``c: ...``) into one line.

Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?P<role>class|meth|func|attr|mod|data|exc|obj|math):`(?P<body>[^`]+)`")
_CALLABLE_ROLES = {"meth", "func"}


class RstRoles(griffe.Extension):
    """Rewrite reST roles and directives in every docstring of the loaded package to Markdown."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = convert(obj.docstring.value, obj)


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)  # type: ignore[arg-type]


def _identifier(target: str, obj: griffe.Object) -> str:
    """The full dotted path a role's target most likely names, resolved from ``obj``'s scope."""
    if target.startswith("lightning_sync."):
        return target
    scopes = [obj] + list(_parents(obj))
    head = target.split(".", 1)[0]
    rest = target[len(head) :]
    for scope in scopes:
        if head in scope.members:
            member = scope.members[head]
            base = member.target_path if member.is_alias else member.path  # type: ignore[union-attr]
            return base + rest
        try:
            resolved = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError, ValueError):
            continue
        return resolved + rest
    if target.startswith(("core.", "comm.", "strategies.", "callbacks.", "data.", "benchmark.")):
        return f"lightning_sync.{target}"
    return target


def _parents(obj: griffe.Object) -> Any:
    parent = obj.parent
    while parent is not None:
        yield parent
        parent = parent.parent


def _role(match: re.Match[str], obj: griffe.Object) -> str:
    role, body = match["role"], match["body"]
    if role == "math":
        return f"\\({body}\\)"
    short = body.startswith("~")
    target = body.lstrip("~").strip()
    if "<" in target and target.endswith(">"):  # :class:`title <target>`
        title, target = target[:-1].split("<", 1)
        title = title.strip()
    else:
        title = target.rsplit(".", 1)[-1] if short else target
        if role in _CALLABLE_ROLES and not title.endswith(")"):
            title += "()"
    identifier = html.escape(_identifier(target.rstrip("()"), obj), quote=True)
    return f'<autoref identifier="{identifier}" optional><code>{html.escape(title)}</code></autoref>'


def _math_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if not stripped.startswith(".. math::"):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(stripped)
        body = [stripped[len(".. math::") :].strip()]
        i += 1
        while i < len(lines):
            nxt = lines[i]
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt.strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        text = "\n".join(b for b in body if b)
        pad = " " * indent
        if out and out[-1].strip():
            out.append("")
        out.extend([pad + "$$", *(pad + b for b in text.splitlines()), pad + "$$", ""])
    return out


def _join_split_names(lines: list[str]) -> list[str]:
    """``Args:`` entries whose comma-separated names continue on the next line: join the two lines."""
    out: list[str] = []
    in_args = False
    for line in lines:
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters|Other Parameters):", stripped):
            in_args = True
        elif stripped and not line.startswith(" "):
            in_args = False
        prev = out[-1] if out else ""
        if (
            in_args
            and prev.startswith("    ")
            and not prev.startswith("     ")
            and prev.rstrip().endswith(",")
            and ":" not in prev
        ):
            out[-1] = prev.rstrip() + " " + stripped
            continue
        out.append(line)
    return out


def convert(text: str, obj: griffe.Object) -> str:
    """``text`` (a docstring) with its reST markup rewritten to Markdown."""
    lines = _join_split_names(_math_blocks(text.splitlines()))
    text = "\n".join(lines)
    text = re.sub(r"(?m)(\S)::$", r"\1:", text)
    text = re.sub(r"(?m)^(\s*)::$", r"\1", text)
    return _ROLE.sub(lambda m: _role(m, obj), text)

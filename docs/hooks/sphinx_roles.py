"""griffe extension: render scalestate's docstrings and attrs classes as ``help()`` shows them.

The docstrings are Google style, read both by ``help()`` and by this site, and
use a few reStructuredText idioms that Markdown does not know:

* roles such as :class:`~scalestate.errors.PhaseError` or :meth:`step`
  become links to the API reference where the target is documented there
  (resolved in the docstring's own scope, as Sphinx would), else code;
* ``.. warning::`` (and the other admonition directives) become admonitions;
* a paragraph ending in ``::`` before an indented block ends in ``:``;
* an argument line naming several parameters (``device, dtype: as in
  torch.nn.Linear``), readable in ``help()``, becomes one line per parameter,
  so that each is matched with its signature;
* doctest blocks (``>>>`` lines and their output, up to a blank line) become
  ``pycon`` code blocks wherever they are (an ``Example:`` section is an
  admonition in Google style, whose body is Markdown).

Two conventions that static analysis does not know are also read:

* ``#:`` comments above an attribute (the Sphinx convention used for attrs
  fields and constants) become the attribute's docstring;
* ``@attrs.frozen`` / ``@attrs.define`` classes get the ``__init__`` attrs
  generates (fields in order, defaults, ``kw_only``, ``init=False`` and the
  leading underscore attrs strips), so their signature is shown.

The links are *optional* cross-references: a target not rendered on any page
(a private helper, a third-party name) shows as code instead of failing the
strict build.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj|const):`([^`]+)`")
_DIRECTIVE = re.compile(
    r"^(?P<indent>[ \t]*)\.\. (?P<kind>warning|note|tip|important|caution|danger|attention)::[ \t]*(?P<text>.*)$"
)
_LITERAL = re.compile(r"(?<=\S)::$")
_CALLABLE_ROLES = {"func", "meth"}
_PARAM_SECTION = re.compile(
    r"^(?P<indent>[ \t]*)(?:Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters):[ \t]*$"
)
_GROUPED = re.compile(
    r"^(?P<indent>[ \t]+)(?P<names>\*{0,2}\w+(?:[ \t]*,[ \t]*\*{0,2}\w+)+)(?P<rest>[ \t]*(?:\([^)]*\))?:[ \t].*)$"
)


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path of ``target`` as seen from ``obj``'s docstring, or ``None``."""
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            scope = scope.parent
            continue
        return f"{path}.{rest}" if rest else path
    return None


def _documented(pkg: griffe.Module, path: str) -> bool:
    """Whether ``path`` names an object of the package (aliases followed)."""
    root, _, rest = path.partition(".")
    if root != pkg.name:
        return False
    try:
        target = pkg[rest] if rest else pkg
        while isinstance(target, griffe.Alias):
            target = target.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return not target.is_private


def _roles(pkg: griffe.Module, obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        role, target = match.group(1), match.group(2).strip()
        short = target.startswith("~")
        target = target.lstrip("~.")
        label = target.rsplit(".", 1)[-1] if short else target
        if role in _CALLABLE_ROLES:
            label += "()"
        path = _resolve(obj, target) if not target.startswith(f"{pkg.name}.") else target
        if path is None or not _documented(pkg, path):
            return f"`{label}`"
        return f'<autoref identifier="{escape(path)}" optional><code>{escape(label)}</code></autoref>'

    return _ROLE.sub(replace, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_grouped(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    section: int | None = None  # the indent of the parameter section being read
    i = 0
    while i < len(lines):
        line = lines[i]
        header = _PARAM_SECTION.match(line)
        if header is not None:
            section = len(header["indent"])
        elif line.strip() and section is not None and _indent(line) <= section:
            section = None
        grouped = _GROUPED.match(line) if section is not None else None
        if grouped is None or _indent(line) <= (section or 0):
            out.append(line)
            i += 1
            continue
        item = _indent(line)
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > item):
            end += 1
        while end > i + 1 and not lines[end - 1].strip():
            end -= 1
        for name in (n.strip() for n in grouped["names"].split(",")):
            out.append(f"{grouped['indent']}{name}{grouped['rest']}")
            out.extend(lines[i + 1 : end])
        i = end
    return "\n".join(out)


def _blocks(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(indent + lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].strip())
                i += 1
            out.append(f"{indent}```")
            continue
        directive = _DIRECTIVE.match(line)
        if directive is None:
            out.append(_LITERAL.sub(":", line))
            i += 1
            continue
        indent = directive["indent"]
        body = [directive["text"]] if directive["text"] else []
        i += 1
        # the directive's body: the lines indented deeper than the directive (blank lines inside it kept)
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        out.append(f"{indent}!!! {directive['kind']}")
        out.append("")
        out.extend(f"{indent}    {b}" if b else "" for b in body)
        out.append("")
    return "\n".join(out)


_ATTRS_DECORATORS = {
    "attrs.frozen", "attrs.define", "attrs.mutable", "attrs.attrs", "attr.s", "attr.attrs",
    "attr.frozen", "attr.define", "attr.mutable", "attr.dataclass",
}
_ATTRS_FIELDS = {"attrs.field", "attr.field", "attr.ib", "attr.attrib"}


def _comment_docstring(attr: griffe.Attribute) -> None:
    """Give ``attr`` the ``#:`` comment lines right above it as its docstring."""
    if attr.docstring is not None or attr.lineno is None or attr.filepath is None:
        return
    try:
        lines = attr.lines_collection[attr.filepath]
    except (KeyError, TypeError):
        return
    comment: list[str] = []
    index = attr.lineno - 2  # the line above, 0-based
    while index >= 0 and lines[index].strip().startswith("#:"):
        comment.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    if comment:
        attr.docstring = griffe.Docstring("\n".join(comment), lineno=index + 2, parent=attr)


def _call(expr: object, names: set[str]) -> griffe.ExprCall | None:
    if isinstance(expr, griffe.ExprCall) and str(getattr(expr, "canonical_path", "")) in names:
        return expr
    return None


def _keywords(call: griffe.ExprCall | None) -> dict[str, Any]:
    if call is None:
        return {}
    return {a.name: a.value for a in call.arguments if isinstance(a, griffe.ExprKeyword)}


def _attrs_init(cls: griffe.Class) -> None:
    """Add the ``__init__`` attrs generates to an attrs class that defines none."""
    decorator = None
    for candidate in cls.decorators:
        value = candidate.value
        path = str(getattr(value, "canonical_path", "")) if not isinstance(value, griffe.ExprCall) else str(
            getattr(value.function, "canonical_path", "")
        )
        if path in _ATTRS_DECORATORS:
            decorator = value
            break
    if decorator is None or "__init__" in cls.members:
        return
    class_kw = _keywords(decorator if isinstance(decorator, griffe.ExprCall) else None)
    if str(class_kw.get("init", "True")) == "False":
        return
    parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
    for member in cls.members.values():
        if not isinstance(member, griffe.Attribute) or member.annotation is None or "property" in member.labels:
            continue
        if "class-attribute" in member.labels and "instance-attribute" not in member.labels:
            continue
        if "ClassVar" in str(member.annotation):
            continue
        field = _keywords(_call(member.value, _ATTRS_FIELDS))
        if str(field.get("init", "True")) == "False":
            continue
        if _call(member.value, _ATTRS_FIELDS) is not None:
            default = field.get("default")
            if "factory" in field:
                default = griffe.ExprCall(function=field["factory"], arguments=[])
            member.value = default  # show the field's default, not the attrs.field(...) call
        else:
            default = member.value
        keyword_only = "True" in (str(class_kw.get("kw_only")), str(field.get("kw_only")))
        parameters.append(
            griffe.Parameter(
                str(field.get("alias", "")).strip("'\"") or member.name.lstrip("_"),
                annotation=member.annotation,
                kind=griffe.ParameterKind.keyword_only if keyword_only else griffe.ParameterKind.positional_or_keyword,
                default=default,
            )
        )
    init = griffe.Function("__init__", parameters=griffe.Parameters(*parameters), returns="None", lineno=cls.lineno)
    cls.set_member("__init__", init)
    init.labels.add("attrs-generated")


class SphinxRoles(griffe.Extension):
    """Rewrite the reStructuredText idioms of every docstring of the package into Markdown."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite the docstrings of ``pkg`` once it is fully loaded."""
        self._visit(pkg, pkg, seen=set())

    def _visit(self, pkg: griffe.Module, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if isinstance(obj, griffe.Attribute):
            _comment_docstring(obj)
        if isinstance(obj, griffe.Class):
            _attrs_init(obj)
        if obj.docstring is not None:
            obj.docstring.value = _roles(pkg, obj, _blocks(_split_grouped(obj.docstring.value)))
        for member in list(obj.members.values()):
            if not isinstance(member, griffe.Alias):
                self._visit(pkg, member, seen)

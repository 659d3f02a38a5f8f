"""Every signature the docs write for a public function is the function's
own: parameter names, order, kinds (positional, keyword-only after ``*``)
and defaults against ``inspect.signature``. A page that says ``causal=False``
where the code has no default sends its reader to a silently wrong call.

Where a signature is read (a page's ``name(params)`` is a signature there,
not a call, and is checked):

- in a fenced block marked ``<!-- not-run: ... signatures ... -->``: every
  ``name(...)`` of a public function; a line ``commlib.ring: f(...)`` names
  the module of the names that follow it in the block;
- elsewhere, in a code span that opens a table row or a list item, or one
  whose parameters have a ``*`` (keyword-only) marker.

A name is looked up as written (``ring.ring_attention``,
``commlib.hybrid.plan``), else in the module the block or the last heading
names (a heading with ``commlib.bindings.torch`` in backticks), else in the
page's modules (``PAGES``); ``.method(...)`` and a bare name not found
there are read on the class named last on the same line. Names that
resolve to nothing are not API (``forward(q, k, v, causal, scale)``, the
kernel contract) and are left alone."""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import pytest

import requires

requires.module("torch")
requires.module("jax")
requires.module("transformers")

ROOT = Path(__file__).resolve().parents[1]

# each page that lists signatures, and the modules its bare names come from
PAGES = {
    "architecture.md": ["commlib"],
    "ring.md": ["commlib.ring", "commlib.kernels", "commlib.sequence.documents"],
    "ulysses.md": ["commlib.ulysses", "commlib.hybrid"],
    "bindings.md": ["commlib.bindings.torch", "commlib.bindings.jax"],
    "masks.md": ["commlib.sequence.masks", "commlib.sequence.common_masks",
                 "commlib.sequence.balanced", "commlib.ring.sparse"],
    "inference.md": ["commlib.inference", "commlib.bindings.transformers"],
    "moe.md": ["commlib.moe"],
    "diffusers.md": ["commlib.bindings.diffusers"],
    "latent.md": ["commlib.ring", "commlib.inference", "commlib.bindings.torch"],
}
ALIASES = {"ring": "commlib.ring", "ulysses": "commlib.ulysses", "hybrid": "commlib.hybrid",
           "moe": "commlib.moe", "ct": "commlib.bindings.torch", "cj": "commlib.bindings.jax"}
FENCE = re.compile(r"^\s*```")
LISTING = re.compile(r"<!--\s*not-run:[^>]*signatures")
MODULE_LINE = re.compile(r"^\s*(commlib(?:\.\w+)*):\s")
HEADING_MODULE = re.compile(r"^(?:#+ |\*\*).*?`(commlib(?:\.\w+)+)`")
CALL = re.compile(r"(?<![\w.)\]])(\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(")
SPAN = re.compile(r"`([^`]+)`")
LEADING_SPAN = re.compile(r"^\s*(?:[-*] |\|\s*)`")


@dataclass(frozen=True)
class Written:
    """One signature as a page writes it."""

    page: str
    line: int
    name: str
    params: str
    module: Optional[str]   # the block's or the heading's module
    owner: Optional[Any]    # the class named before it on its line


def _closing(text: str, start: int) -> Optional[int]:
    """Index of the parenthesis closing the one before ``start``."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def _uncommented(line: str) -> str:
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#":
            return line[:i]
    return line


def _signatures(text: str) -> Iterator[Tuple[int, str, str]]:
    """(offset, name, params) of each top-level ``name(params)`` of text."""
    at = 0
    while (match := CALL.search(text, at)) is not None:
        end = _closing(text, match.end())
        if end is None:
            return
        yield match.start(), match.group(1), text[match.end():end]
        at = end + 1


def written(page: str) -> List[Written]:
    """The signatures ``page`` writes (the module docstring says where)."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            close = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
            marker = next((x for x in reversed(lines[:i]) if x.strip()), "")
            if LISTING.search(marker):
                found += _in_listing(page, lines, i + 1, close)
            i = close
        i += 1
    outside = list(_outside_blocks(lines))
    headings, heading = [], None
    for line in outside:
        match = HEADING_MODULE.match(line)
        heading = match.group(1) if match else heading
        headings.append(heading)
    text = "\n".join(outside)
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    for span in SPAN.finditer(text):
        number = text.count("\n", 0, span.start())
        line, column = outside[number], span.start() - starts[number]
        leading = (LEADING_SPAN.match(line) is not None and column == line.index("`")) or \
            (line.lstrip().startswith("|") and column < line.index("|", line.index("|") + 1))
        for offset, name, params in _signatures(span.group(1)):
            if offset == 0 and _is_signature(params, leading):
                found.append(Written(page, number + 1, name, params, headings[number],
                                     _owner_in(line[:column], headings[number], page)))
    return found


def _outside_blocks(lines: Sequence[str]) -> Iterator[str]:
    """The page with every fenced block's lines blanked (numbers kept)."""
    inside = False
    for line in lines:
        if FENCE.match(line):
            inside = not inside
            yield ""
        else:
            yield "" if inside else line


def _is_signature(params: str, leading: bool) -> bool:
    arguments = _parsed(params)
    if arguments is None:
        return False
    return leading or bool(arguments.kwonlyargs) or arguments.vararg is not None


def _in_listing(page: str, lines: Sequence[str], start: int, stop: int) -> List[Written]:
    found, module = [], None
    text = "\n".join(_uncommented(x) for x in lines[start:stop])
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    for offset, name, params in _signatures(text):
        number = text.count("\n", 0, offset)
        line = text[starts[number]:offset]
        heading = MODULE_LINE.match(text[starts[number]:])
        module = heading.group(1) if heading else module
        found.append(Written(page, start + number + 1, name, params, module,
                             _owner_in(line, module, page)))
    return found


def _owner_in(before: str, module: Optional[str], page: str) -> Optional[Any]:
    """The last class named in ``before`` (for ``.method(...)``)."""
    for name in reversed(re.findall(r"(?<![\w.])([A-Z]\w*)\(", before)):
        found = _resolve(name, module, page, None)
        if inspect.isclass(found):
            return found
    return None


def _module(name: str) -> Optional[Any]:
    try:
        return importlib.import_module(ALIASES.get(name, name))
    except ImportError:
        return None


def _public(module: Any, name: str) -> Optional[Any]:
    names = getattr(module, "__all__", None)
    if names is not None and name not in names and not isinstance(
            getattr(module, name, None), type(module)):
        return None
    return getattr(module, name, None)


def _resolve(name: str, module: Optional[str], page: str, owner: Optional[Any]) -> Optional[Any]:
    """The public function or class ``name`` means on ``page`` (None: not API)."""
    if name.startswith("."):
        return getattr(owner, name[1:], None) if owner is not None else None
    head, _, last = name.rpartition(".")
    if head:
        parent = _module(head)
        return _public(parent, last) if parent is not None else None
    for where in ([module] if module else []) + PAGES[page]:
        found = _public(importlib.import_module(where), name)
        if found is not None:
            return found
    return getattr(owner, name, None) if owner is not None else None


def _parsed(params: str) -> Optional[ast.arguments]:
    try:
        tree = ast.parse(f"def f({params}):\n    pass")
    except SyntaxError:
        return None
    return tree.body[0].args


def _value(node: ast.expr) -> Any:
    """A written default's value; ``inf`` is ``float("inf")``, as pages write it."""
    return eval(compile(ast.Expression(node), "<doc>", "eval"),
                {"__builtins__": {}, "inf": math.inf})


def _doc_parameters(arguments: ast.arguments) -> List[Tuple[str, str, Any]]:
    """(name, kind, default) as the page writes them."""
    positional = arguments.posonlyargs + arguments.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(arguments.defaults)) + \
        [_value(d) for d in arguments.defaults]
    rows = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    if arguments.vararg:
        rows.append((arguments.vararg.arg, "*args", inspect.Parameter.empty))
    rows += [(a.arg, "keyword-only", inspect.Parameter.empty if d is None else _value(d))
             for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg:
        rows.append((arguments.kwarg.arg, "**kwargs", inspect.Parameter.empty))
    return rows


KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional",
         inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
         inspect.Parameter.VAR_POSITIONAL: "*args",
         inspect.Parameter.KEYWORD_ONLY: "keyword-only",
         inspect.Parameter.VAR_KEYWORD: "**kwargs"}


def _code_parameters(function: Any, method: bool) -> List[Tuple[str, str, Any]]:
    parameters = list(inspect.signature(function).parameters.values())
    if method and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    return [(p.name, KINDS[p.kind], p.default) for p in parameters]


def _shown(default: Any) -> str:
    return "no default" if default is inspect.Parameter.empty else f"default {default!r}"


def differences(doc: Sequence[Tuple[str, str, Any]],
                code: Sequence[Tuple[str, str, Any]]) -> List[str]:
    """What differs between the page's parameters and the code's, in words."""
    if [name for name, _, _ in doc] != [name for name, _, _ in code]:
        return [f"parameters ({', '.join(n for n, _, _ in doc)}) but the code has "
                f"({', '.join(n for n, _, _ in code)})"]
    problems = []
    for (name, kind, default), (_, real_kind, real_default) in zip(doc, code):
        if kind != real_kind:
            problems.append(f"{name} {kind} but the code's is {real_kind}")
        if default is not real_default and not (
                default is not inspect.Parameter.empty and
                real_default is not inspect.Parameter.empty and default == real_default):
            problems.append(f"{name} with {_shown(default)} but the code's has "
                            f"{_shown(real_default)}")
    return problems


def checks(page: str) -> List[Tuple[Written, Any]]:
    """The page's signatures of public functions, each with its function."""
    found = []
    for entry in written(page):
        function = _resolve(entry.name, entry.module, page, entry.owner)
        if function is not None and callable(function):
            found.append((entry, function))
    return found


def _id(check: Tuple[Written, Any]) -> str:
    entry, _ = check
    return f"{entry.page}:{entry.line}:{entry.name}"


CHECKS = [check for page in PAGES for check in checks(page)]


@pytest.mark.parametrize("check", CHECKS, ids=[_id(c) for c in CHECKS])
def test_a_written_signature_is_the_codes(check):
    entry, function = check
    arguments = _parsed(entry.params)
    assert arguments is not None, f"docs/{entry.page}:{entry.line}: {entry.name}({entry.params})"
    method = entry.name.startswith(".") or entry.owner is not None and \
        getattr(entry.owner, entry.name.rpartition(".")[2], None) is function
    problems = differences(_doc_parameters(arguments), _code_parameters(function, method))
    assert not problems, f"docs/{entry.page}:{entry.line}: {entry.name}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_every_listing_page_has_signatures_checked(page):
    """The reader finds something on every page: a format it no longer
    recognizes fails here rather than checking nothing."""
    assert [c for c in CHECKS if c[0].page == page], page


def test_a_wrong_default_and_a_lost_keyword_only_marker_are_named():
    def f(q, comm, *, layout, causal, mask=None):
        """Stands in for an attention function."""

    doc = _doc_parameters(_parsed("q, comm, layout, causal=False, mask=None"))
    problems = differences(doc, _code_parameters(f, False))
    assert problems == ["layout positional but the code's is keyword-only",
                        "causal positional but the code's is keyword-only",
                        "causal with default False but the code's has no default",
                        "mask positional but the code's is keyword-only"]
    assert differences(_doc_parameters(_parsed("q, comm, *, causal, layout, mask=None")),
                       _code_parameters(f, False)) == [
        "parameters (q, comm, causal, layout, mask) but the code has "
        "(q, comm, layout, causal, mask)"]

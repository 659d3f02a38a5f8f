"""The fenced blocks of README.md and docs/*.md, what each one says about
how it is run, and the comparison of a run's output with the output a doc
shows. tests/test_docs.py runs them; the convention is described there.

Kept apart from the test so that the checker itself can be tested on
deliberately wrong snippets."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
CODE_LANGUAGES = ("python", "py")
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"^\s*<!--\s*(run|not-run|output|file)\s*(?::\s*(.*?))?\s*-->\s*$")
LAUNCH_HEADER = re.compile(
    r"^#\s*((?:\w+=\S+\s+)*(?:mpiexec\s+-n\s+\d+\s+)?python)\s+(\S+\.py)\s*$")
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")
OPTION_KEYS = ("rtol", "atol")


def docs() -> List[Path]:
    """Every page the docs test covers."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Launch:
    """How a code block is started: environment, ranks (None: plain python)."""

    env: Tuple[Tuple[str, str], ...]
    nprocs: Optional[int]

    @classmethod
    def parse(cls, text: str) -> "Launch":
        words = shlex.split(text)
        env = []
        while words and "=" in words[0]:
            key, value = words.pop(0).split("=", 1)
            env.append((key, value))
        if words[-1:] == ["python"]:
            words.pop()
        if not words:
            return cls(tuple(env), None)
        if len(words) == 3 and words[:2] == ["mpiexec", "-n"] and words[2].isdigit():
            return cls(tuple(env), int(words[2]))
        raise ValueError(f"cannot read the launch {text!r}: write `mpiexec -n N`, "
                         "`python`, optionally after VAR=value settings")

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        ranks = f"mpiexec -n {self.nprocs} python" if self.nprocs else "python"
        return f"{env} {ranks}".strip()


@dataclass(frozen=True)
class Options:
    """How shown output is compared: numbers free (timings), or within
    ``atol + rtol * |shown|``; integers exactly unless timings."""

    timings: bool = False
    rtol: float = 1e-3
    atol: float = 1e-5


@dataclass
class Block:
    path: Path
    line: int                  # 1-based line of the opening fence
    language: str
    text: str
    marker: Optional[Tuple[str, str]]   # (kind, argument) of the comment above it
    launches: List[Launch] = field(default_factory=list)
    options: Options = Options()
    header_file: Optional[str] = None   # `# mpiexec -n 3 python examples/x.py` names this

    @property
    def where(self) -> str:
        inside = ROOT in self.path.parents
        return f"{self.path.relative_to(ROOT) if inside else self.path}:{self.line}"

    @property
    def kind(self) -> Optional[str]:
        if self.marker:
            return self.marker[0]
        return "run" if self.header_file else None


def parse(path: Path) -> List[Block]:
    """The fenced blocks of one page, each with the marker right above it."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        stripped = lines[index].strip()
        if not stripped.startswith("```"):
            index += 1
            continue
        indent = len(lines[index]) - len(lines[index].lstrip())
        start, body = index, []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index][indent:])
            index += 1
        if index == len(lines):
            raise ValueError(f"{path}:{start + 1}: a fence that is never closed")
        index += 1
        before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        match = MARKER.match(before)
        marker = (match.group(1), match.group(2) or "") if match else None
        blocks.append(_describe(Block(path, start + 1, stripped[3:].strip(), "\n".join(body),
                                      marker)))
    return blocks


def _describe(block: Block) -> Block:
    """Fill in launches, options and a launch header from the marker and text."""
    first = block.text.splitlines()[0] if block.text else ""
    header = LAUNCH_HEADER.match(first) if block.language in CODE_LANGUAGES else None
    if header:
        block.header_file = header.group(2)
        block.launches = [Launch.parse(header.group(1))]
    if block.kind in ("run", "output") and block.marker:
        launches, options = [], {}
        for item in filter(None, (x.strip() for x in block.marker[1].split(";"))):
            key, _, value = item.partition("=")
            if item == "timings":
                options["timings"] = True
            elif key in OPTION_KEYS:
                options[key] = float(value)
            else:
                launches.append(Launch.parse(item))
        block.options = Options(**options)
        if launches:
            block.launches = launches
    return block


def problems_of(block: Block) -> List[str]:
    """What is wrong with a block's marking, so that nothing goes unchecked
    by accident: every block is run, shown output, a file, or not-run with a
    reason."""
    kind = block.kind
    if kind is None:
        return [f"{block.where}: unmarked block: put <!-- run: mpiexec -n N -->, "
                "<!-- output -->, <!-- file: NAME --> or <!-- not-run: REASON --> above it"]
    if kind == "not-run" and not block.marker[1]:
        return [f"{block.where}: <!-- not-run --> needs a reason"]
    if kind == "file" and not block.marker[1]:
        return [f"{block.where}: <!-- file: NAME --> needs a name"]
    if kind == "run" and block.language in CODE_LANGUAGES and not block.launches:
        return [f"{block.where}: a python block to run needs its launch, "
                "<!-- run: mpiexec -n N --> or <!-- run: python -->"]
    if kind == "run" and block.language not in CODE_LANGUAGES + SHELL_LANGUAGES \
            and not block.text.startswith("$ "):
        return [f"{block.where}: a text block to run starts with `$ command`"]
    return []


@dataclass
class Check:
    """One thing the docs test runs: a code block at its launches with the
    output shown for each, or shell commands with theirs."""

    block: Block
    expected: List[Tuple[Optional[str], Optional[str], Options]]  # (prompt, output, options)
    files: Dict[str, str]      # files the page wrote before this block

    @property
    def name(self) -> str:
        return self.block.where


def plan(path: Path) -> List[Check]:
    """The checks of one page, each code block paired with the output block
    that follows it (before the next block that runs)."""
    checks: List[Check] = []
    files: Dict[str, str] = {}
    current: Optional[Check] = None
    for block in parse(path):
        kind = block.kind
        if kind == "file":
            files[block.marker[1]] = block.text + "\n"
        elif kind == "run" and block.language in CODE_LANGUAGES:
            current = Check(block, [], dict(files))
            checks.append(current)
        elif kind == "run":
            checks.append(Check(block, _sections(block.text, block.options), dict(files)))
            current = None
        elif kind == "output":
            if current is None:
                raise ValueError(f"{block.where}: <!-- output --> with no python block run "
                                 "before it")
            current.expected = _sections(block.text, block.options)
            current = None
    return checks


def _sections(text: str, options: Options) -> List[Tuple[Optional[str], Optional[str], Options]]:
    """Split shown output at its `$ command` lines: (command, output) pairs."""
    sections: List[Tuple[Optional[str], List[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            sections.append((line[2:].strip(), []))
        else:
            if not sections:
                sections.append((None, []))
            sections[-1][1].append(line)
    return [(prompt, "\n".join(body), options) for prompt, body in sections]


def compare(shown: str, got: str, options: Options = Options()) -> List[str]:
    """How ``got`` differs from ``shown``, line by line (blank lines and
    runs of spaces ignored): the text between numbers must be equal; numbers
    are free under ``timings``, else integers equal and other numbers within
    ``atol + rtol * |shown|``."""
    want = [line for line in shown.splitlines() if line.strip()]
    have = [line for line in got.splitlines() if line.strip()]
    problems = []
    if len(want) != len(have):
        problems.append(f"{len(have)} lines of output where the doc shows {len(want)}")
    for number, (a, b) in enumerate(zip(want, have), 1):
        problem = _compare_line(a, b, options)
        if problem:
            problems.append(f"line {number}: {problem}\n    doc: {a.strip()}\n    got: {b.strip()}")
    return problems


def _skeleton(line: str) -> Tuple[str, List[str]]:
    return " ".join(NUMBER.sub("#", line).split()), NUMBER.findall(line)


def _compare_line(shown: str, got: str, options: Options) -> Optional[str]:
    (text_a, numbers_a), (text_b, numbers_b) = _skeleton(shown), _skeleton(got)
    if text_a != text_b:
        return "the text differs"
    if options.timings:
        return None
    for a, b in zip(numbers_a, numbers_b):
        if re.fullmatch(r"[-+]?\d+", a) and re.fullmatch(r"[-+]?\d+", b):
            if int(a) != int(b):
                return f"{b} where the doc shows {a}"
        elif abs(float(a) - float(b)) > options.atol + options.rtol * abs(float(a)):
            return f"{b} is not within tolerance of {a}"
    return None


def prompt_ranks(prompt: str) -> Optional[int]:
    """The rank count a `$ mpiexec -n N ...` line names."""
    match = re.search(r"mpiexec\s+-n\s+(\d+)", prompt)
    return int(match.group(1)) if match else None

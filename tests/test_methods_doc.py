"""docs/methods.md cites code that exists: every citation names a definition that is still in
the cited file, and the cited lines still lie inside it.

A citation is two code spans, a name and a location, separated by one space or a line
break (and the indentation of a list item):

    `igpo_family_advantages` `a2tgpo/algo/advantages.py:216-225`

The name is a function, class or module-level assignment (`CITATIONS`), dotted for members
(`LossConfig.adaptive_clip`, `RolloutTree.register`), or `__doc__` for the module docstring.
The location is a repository path, then one line or an inclusive range. The definition's span
comes from `ast` (decorators included, through its last line). A location without a name in
front of it is an error too, so a citation in another shape cannot go unchecked.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "methods.md"

LOCATION = r"`(?P<path>[\w./-]+\.py):(?P<start>\d+)(?:-(?P<end>\d+))?`"
CITATION = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)`(?: |\n *)" + LOCATION)
ANY_LOCATION = re.compile(r"`[^`\s]+\.py:[^`]*`")
# repository paths named without lines must exist too
REPO_PATH = re.compile(r"`((?:a2tgpo|tests|config|docs|bench|scripts|workflow)/[^`\s:]+)`")
# the sections the doc must have, each with at least one citation: both papers, the baselines
# the study runs, and the no-training baseline
SECTIONS = ("A2TGPO", "AT2PO", "GRPO", "DAPO", "GSPO", "Tree-GRPO", "GiGPO", "IGPO", "AEPO",
            "ReAct")


def _spans(tree: ast.Module, name: str) -> list[tuple[int, int]]:
    """(first, last) line of every definition `name` (dotted through classes and functions)."""
    if name == "__doc__":
        doc = tree.body[0] if tree.body else None
        if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            return [(doc.lineno, doc.end_lineno)]
        return []
    found: list[ast.AST] = []
    bodies = [tree.body]
    parts = name.split(".")
    for i, part in enumerate(parts):
        found = [node for body in bodies for node in body if _defines(node, part)]
        bodies = [node.body for node in found if hasattr(node, "body")]
        if i < len(parts) - 1 and not bodies:
            return []
    return [(min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]),
             n.end_lineno) for n in found]


def _defines(node: ast.AST, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def citation_errors(text: str, root: Path = ROOT, doc: str = "docs/methods.md") -> list[str]:
    """One message per broken citation of `text`, each naming the doc line and its row."""
    lines = text.splitlines()

    def row(offset: int) -> str:
        lineno = text.count("\n", 0, offset) + 1
        return f"{doc}:{lineno} ({lines[lineno - 1].strip()[:90]})"

    errors = []
    cited = list(CITATION.finditer(text))
    covered = {m.start("path") - 1 for m in cited}
    for m in ANY_LOCATION.finditer(text):
        if m.start() not in covered:
            errors.append(f"{row(m.start())}: location {m.group()} has no `name` span right "
                          "before it (write `name` `path.py:first-last`)")
    for m in REPO_PATH.finditer(text):
        if not any(c in m.group(1) for c in "<{*") and not (root / m.group(1)).exists():
            errors.append(f"{row(m.start())}: {m.group(1)} does not exist")
    parsed: dict[Path, tuple[ast.Module, int] | None] = {}
    for m in cited:
        name, rel = m.group("name"), m.group("path")
        start = int(m.group("start"))
        end = int(m.group("end") or start)
        where = row(m.start())
        path = root / rel
        if path not in parsed:
            source = path.read_text() if path.is_file() else None
            parsed[path] = (None if source is None else
                            (ast.parse(source, str(path)), len(source.splitlines())))
        if parsed[path] is None:
            errors.append(f"{where}: {rel} does not exist")
            continue
        tree, n_lines = parsed[path]
        spans = _spans(tree, name)
        if start > end:
            errors.append(f"{where}: {rel}:{start}-{end} is an empty range")
        elif end > n_lines:
            errors.append(f"{where}: {rel}:{start}-{end} runs past the end of the file "
                          f"({n_lines} lines)")
        elif not spans:
            errors.append(f"{where}: `{name}` is not defined in {rel}")
        elif not any(a <= start and end <= b for a, b in spans):
            now = ", ".join(f"{a}-{b}" for a, b in spans)
            errors.append(f"{where}: {rel}:{start}-{end} is not inside `{name}` "
                          f"(now lines {now})")
    return errors


def sections(text: str) -> dict[str, str]:
    """The doc's `## ` sections by their heading's first word."""
    out, name = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].split()[0] if line[3:].split() else ""
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def test_every_citation_points_into_its_definition():
    text = DOC.read_text()
    errors = citation_errors(text)
    assert not errors, ("docs/methods.md cites code that moved or is gone; fix the line "
                        "numbers (the message gives each definition's current lines):\n"
                        + "\n".join(errors))
    # a parser that matched nothing would pass the check above vacuously
    assert len(CITATION.findall(text)) >= 60


def test_every_method_has_a_section_with_citations():
    found = sections(DOC.read_text())
    for name in SECTIONS:
        assert name in found, f"docs/methods.md has no `## {name}` section"
        assert CITATION.search(found[name]), f"docs/methods.md: `## {name}` cites no code"


def test_every_method_id_is_named():
    # config/methods/<id>.yaml is generated from the one method table (a test keeps them equal)
    text = DOC.read_text()
    missing = [p.stem for p in sorted((ROOT / "config" / "methods").glob("*.yaml"))
               if f"`{p.stem}`" not in text]
    assert not missing, f"docs/methods.md never names the method ids {missing}"


# the checker itself, on a file of known shape:
#   1 "Doc."
#   2 (blank)
#   3 def f(x):
#   4     y = x
#   5     return y
#   6 (blank)
#   7 class C:
#   8     a: int = 1
#   9
#  10     def m(self):
#  11         return 1
#  12 T = {1: 2}
MODULE = '"Doc."\n\ndef f(x):\n    y = x\n    return y\n\nclass C:\n    a: int = 1\n\n' \
         '    def m(self):\n        return 1\nT = {1: 2}\n'


@pytest.mark.parametrize("row, problem", [
    ("`f` `a2tgpo/m.py:3-5`", None),
    ("`f` `a2tgpo/m.py:4`", None),
    ("`f`\n`a2tgpo/m.py:3-5`", None),                                            # wrapped
    ("`f`\n  `a2tgpo/m.py:3-5`", None),                                          # in a list
    ("`config/<id>.yaml`", None),                                                 # a pattern
    ("`C.m` `a2tgpo/m.py:10-11`", None),
    ("`C.a` `a2tgpo/m.py:8`", None),
    ("`T` `a2tgpo/m.py:12`", None),
    ("`__doc__` `a2tgpo/m.py:1`", None),
    ("`g` `a2tgpo/m.py:3-5`", "`g` is not defined in a2tgpo/m.py"),           # renamed
    ("`f` `a2tgpo/m.py:4-6`", "is not inside `f` (now lines 3-5)"),            # past its end
    ("`C.m` `a2tgpo/m.py:7-11`", "is not inside `C.m` (now lines 10-11)"),     # before its start
    ("`T` `a2tgpo/m.py:12-13`", "runs past the end of the file (12 lines)"),
    ("`f` `a2tgpo/m.py:5-3`", "is an empty range"),
    ("`f` `a2tgpo/n.py:3-5`", "a2tgpo/n.py does not exist"),                  # missing file
    ("`f`, `a2tgpo/m.py:3-5`", "has no `name` span right before it"),         # wrong shape
    ("`a2tgpo/m.py:3`", "has no `name` span right before it"),
    ("see `a2tgpo/gone.py`", "a2tgpo/gone.py does not exist"),
])
def test_checker(tmp_path, row, problem):
    (tmp_path / "a2tgpo").mkdir()
    (tmp_path / "a2tgpo" / "m.py").write_text(MODULE)
    errors = citation_errors(f"# title\n| Eq. 1 | {row} |\n", tmp_path, "doc.md")
    if problem is None:
        assert errors == []
    else:
        assert len(errors) == 1 and problem in errors[0], errors
        assert errors[0].startswith("doc.md:2 (| Eq. 1 |"), errors  # names the row

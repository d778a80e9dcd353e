"""Every file, test and class member that a docs page or a docstring names exists.

A reference that outlives what it names is the same failure as a doc sample that
never ran, one level up (two docstrings named test files that never existed). Three
kinds are checked, in docs/, README.md and every .py under src/, tests/, bench/,
tools/ and property_tests/:

- a repository path (``tests/...py``, ``src/triollm/...``, ``docs/...md``, ...);
- a test by name, after ``path::`` or alone in backticks;
- a backticked ``Class.member`` whose class is defined in ``src/triollm``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Named by work in flight that has not landed yet, each with who adds it. Delete an
# entry when its file lands (an entry whose file exists is checked like any other).
KNOWN_MISSING = {
    "docs/policies.md": "issue 15 (named by policies.py, check/machine.py)",
}

PATH = re.compile(  # a path with "..." in it is an elided example, not a reference
    r"(?<![\w/.-])((?:src/triollm|tests|docs|bench|tools|property_tests)/(?:\w[\w-]*[/.])*\w*"
    r"\.(?:py|md|json|toml|html|txt|yml|png))(?:::(\w+))?"
)
BARE_TEST = re.compile(r"`(test_\w+)`")
MEMBER = re.compile(r"`{1,2}~?(?:[\w.]*\.)?([A-Z]\w+)\.(_?[a-z_]\w*)(?:\(\))?`{1,2}")


def sources() -> dict[Path, str]:
    files = [*ROOT.glob("docs/**/*.md"), ROOT / "README.md"]
    for top in ("src/triollm", "tests", "bench", "tools", "property_tests"):
        files += ROOT.glob(f"{top}/**/*.py")
    return {p: p.read_text() for p in files if "vendor" not in p.parts and p.is_file()}


def defined_tests() -> set[str]:
    names: set[str] = set()
    for top in ("tests", "property_tests", "src/triollm"):
        for p in ROOT.glob(f"{top}/**/*.py"):
            names.update(re.findall(r"^\s*(?:async )?def (test_\w+)", p.read_text(), re.M))
    return names


def class_members() -> dict[str, set[str]]:
    """Class name -> every member defined in it or its (src/triollm) bases."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for p in ROOT.glob("src/triollm/**/*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = own.setdefault(node.name, set())
            bases.setdefault(node.name, set()).update(
                b.id for b in node.bases if isinstance(b, ast.Name)
            )
            for n in ast.walk(node):
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(n.name)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
                elif isinstance(n, ast.Assign):
                    names.update(t.id for t in n.targets if isinstance(t, ast.Name))
                elif (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                ):
                    names.add(n.attr)

    def members(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set(own.get(name, ()))
        for base in bases.get(name, set()) - seen:
            out |= members(base, seen | {name})
        return out

    return {name: members(name) for name in own}


def test_every_named_file_and_test_exists() -> None:
    tests = defined_tests()
    missing = []
    for source, text in sources().items():
        where = source.relative_to(ROOT)
        for m in PATH.finditer(text):
            path, name = m.group(1), m.group(2)
            target = ROOT / path
            if not target.exists():
                if path not in KNOWN_MISSING:
                    missing.append(f"{where}: {path}")
            elif name and not re.search(rf"(def|class) {name}\b", target.read_text()):
                missing.append(f"{where}: {path}::{name}")
        for name in BARE_TEST.findall(text):
            if name not in tests:
                missing.append(f"{where}: {name}")
    assert not missing, "named but missing:\n" + "\n".join(sorted(set(missing)))


def test_every_named_class_member_exists() -> None:
    members = class_members()
    missing = {
        f"{source.relative_to(ROOT)}: {cls}.{attr}"
        for source, text in sources().items()
        for cls, attr in MEMBER.findall(text)
        if cls in members and attr not in members[cls]
    }
    assert not missing, "named but missing:\n" + "\n".join(sorted(missing))

"""The import layering: each layer imports only the layers below it, and no layer reaches
past its neighbour (docs/architecture.md, "The path of one request").

Read from the source (every ``import`` statement, also the ones inside functions;
those under ``if TYPE_CHECKING:`` are names for the type checker and are left out), so
a lazy import cannot hide a reach. The request path, top to bottom:

    server/*  ->  request (prepare)  ->  spec  ->  admission / service / output
              ->  scheduler (+ kvcache, kv)  ->  batch  ->  model/*

The pure import test (``test_scheduler_purity.py``) checks what the policy layer
loads at run time; this one checks who may name whom.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "triollm"

# The policy core and the frozen messages: the standard library and each other only.
PURE = {
    "errors",
    "outcomes",
    "plan",
    "spec",
    "kv",
    "kvcache",
    "policies",
    "scheduler",
    "sizing",
    "textstream",
    "toolcalls",
    "events",
}
# The trio layer between the edge and the scheduler: it takes specs and never the model
# (the batch is an Executor it is handed; the tokenizer a detokenizer factory).
SERVICE = {"admission", "service", "output"}
# Reaching the model: its own package, the Batch that runs it, and the two drivers
# that build one. Named as prefixes of the module path.
MODEL = ("model", "batch")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> set[str]:
    """The triollm modules ``path`` imports (without the ``triollm.`` prefix)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n.removeprefix("triollm.") for n in names if n.startswith("triollm."))
    return found


def reaches(found: set[str], prefixes: tuple[str, ...] | set[str]) -> list[str]:
    return sorted(name for name in found for p in prefixes if name == p or name.startswith(p + "."))


ALL = {module_name(p): p for p in SRC.rglob("*.py")}


@pytest.mark.parametrize("name", sorted(PURE))
def test_the_pure_core_imports_only_the_pure_core(name: str) -> None:
    outside = {
        n
        for n in imports(ALL[name])
        if n.split(".")[0] not in PURE  # "scheduler.Infeasible" is still scheduler
    }
    assert not outside, f"{name} imports {sorted(outside)}: the policy core must stay pure"


@pytest.mark.parametrize("name", sorted(SERVICE))
def test_the_service_layer_takes_specs_and_never_reaches_the_model(name: str) -> None:
    found = imports(ALL[name])
    assert not reaches(found, MODEL), f"{name} reaches the model: {reaches(found, MODEL)}"
    assert not reaches(found, ("server", "request")), (
        f"{name} reaches up to the edge or to prepare: {reaches(found, ('server', 'request'))}"
    )


# server/command.py is the composition root (`triollm serve`): it builds the Batch,
# the grammar cache and the detokenizer the service is handed, so it alone may.
EDGE = sorted(n for n in ALL if n.startswith("server.") and n != "server.command")


@pytest.mark.parametrize("name", EDGE)
def test_the_edge_reaches_the_model_only_through_prepare(name: str) -> None:
    found = imports(ALL[name])
    assert not reaches(found, MODEL), (
        f"{name} imports {reaches(found, MODEL)}: the edge goes through request.py"
    )


def test_the_edge_names_no_scheduler_internals() -> None:
    for name in EDGE:
        found = {n for n in imports(ALL[name]) if n.startswith("scheduler.")}
        assert found <= {"scheduler.Infeasible"}, f"{name} imports {sorted(found)}"


def test_the_model_layer_knows_nothing_above_it() -> None:
    above = ("service", "output", "admission", "request", "server", "scheduler", "batch")
    for name, path in ALL.items():
        if name.startswith("model."):
            found = reaches(imports(path), above)
            assert not found, f"{name} imports {found}: the model layer is below them"


def test_prepare_is_below_the_edge_and_the_service() -> None:
    found = imports(ALL["request"])
    assert not reaches(found, ("server", "service", "output", "admission")), sorted(found)


def test_nothing_below_the_edge_imports_it() -> None:
    # cli.py dispatches `triollm serve`; mechanisms/live.py is a demo that runs a server.
    allowed = {"cli", "mechanisms.live"}
    for name, path in ALL.items():
        if name.startswith("server.") or name in allowed:
            continue
        found = reaches(imports(path), ("server",))
        assert not found, f"{name} imports {found}"


def test_the_core_of_the_book_names_real_files_at_about_their_size() -> None:
    """docs/architecture.md lists the files a learner reads first, with line counts:
    each must exist, and its count must be within a fifth (or 40 lines) of the file."""
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page.split("## The core of the book", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `src/triollm/([^`]+)` \| (\d+) \|", section, re.M)
    assert len(rows) >= 10, "the core of the book lists its files"
    for path, stated in rows:
        file = SRC / path
        assert file.is_file(), f"{path} is listed but does not exist"
        lines = len(file.read_text(encoding="utf-8").splitlines())
        assert abs(lines - int(stated)) <= max(40, lines // 5), (
            f"{path}: the page says {stated} lines, the file has {lines}"
        )

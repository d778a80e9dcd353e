"""A dependency our code adapts to one version is pinned to exactly that version."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from triollm.server import transport

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirement(name: str) -> Requirement:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    return req


def test_pyproject_admits_only_the_hypercorn_versions_the_write_guard_accepts() -> None:
    """transport.install() turns the slow-client write deadline off, with only a log
    line, on any hypercorn it was not written against: a resolver that may pick a
    patch release would silently drop the guard in production."""
    spec = requirement("hypercorn").specifier
    candidates = {f"0.{minor}.{patch}" for minor in (17, 18, 19) for patch in range(10)}
    candidates |= set(transport.PINNED_VERSIONS)
    admitted = {v for v in candidates if spec.contains(Version(v), prereleases=True)}
    assert admitted == set(transport.PINNED_VERSIONS), (str(spec), admitted)

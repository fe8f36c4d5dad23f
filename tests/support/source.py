"""The project's own source, for the tests that read it (who imports whom, calls no module
may make, what the docs name): one list of the packages that ship."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Every package that ships: the services, what they share, the platforms, the stores and
#: the operator's tooling.
PACKAGES = ("services", "shared", "platforms", "stores", "chatq")


def python_files(root: Path = ROOT) -> list[Path]:
    """Every Python module of those packages under ``root``, in path order."""
    return sorted(p for top in PACKAGES for p in (root / top).rglob("*.py"))

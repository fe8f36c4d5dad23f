"""Who may import whom, held on the source (imports inside functions included): no service
imports another; the layers go one way, services -> platforms -> stores -> shared, so
shared/ imports nothing above it, a store no platform, and neither a service; no service
imports the operator's tooling (``python -m services``, the
development runner, reads its env file through it). The receiver once imported the
responder's adapters, and shared/ the receiver's Telegram webhook."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.source import PACKAGES, ROOT, python_files


def owner(module: str) -> str | None:
    """The part a module belongs to: ``services.<name>`` for a service, else its package."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1 and parts[1] != "__main__":
        return f"services.{parts[1]}"
    return parts[0] if parts[0] in PACKAGES else None


def imports(root: Path = ROOT) -> set[tuple[str, str, str]]:
    """(importing part, imported part, file) for every absolute or relative import."""
    found: set[tuple[str, str, str]] = set()
    for path in python_files(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        source = owner(module)
        package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                names = [".".join([*base, *([node.module] if node.module else [])])]
            for name in names:
                target = owner(name)
                if source and target and target != source:
                    found.add((source, target, str(path.relative_to(root))))
    return found


def test_no_service_imports_another_service() -> None:
    crossing = sorted(
        (src, dst, f)
        for src, dst, f in imports()
        if src.startswith("services.") and dst.startswith("services.")
    )
    assert crossing == []


def test_shared_imports_no_service_platform_store_or_tooling() -> None:
    assert sorted((dst, f) for src, dst, f in imports() if src == "shared") == []


def test_the_platform_and_store_packages_import_no_service_and_no_tooling() -> None:
    upward = sorted(
        (src, dst, f)
        for src, dst, f in imports()
        if src in ("platforms", "stores") and (dst.startswith("services") or dst == "chatq")
    )
    assert upward == []


def test_the_stores_import_only_shared_so_the_layers_go_one_way() -> None:
    """services -> platforms -> stores -> shared: a store knows no platform."""
    assert sorted((dst, f) for src, dst, f in imports() if src == "stores" and dst != "shared") == []


def test_only_the_development_runner_of_all_three_services_imports_the_tooling() -> None:
    assert (
        sorted(
            f
            for src, dst, f in imports()
            if src.startswith("services") and dst == "chatq" and f != "services/__main__.py"
        )
        == []
    )
    runner = (ROOT / "services" / "__main__.py").read_text(encoding="utf-8")
    assert "from chatq.envfile import" in runner  # the one allowed: it reads the .env file


def test_the_rules_see_an_import_that_breaks_them_relative_or_inside_a_function(tmp_path: Path) -> None:
    receiver = tmp_path / "services" / "receiver"
    receiver.mkdir(parents=True)
    (receiver / "late.py").write_text("def f():\n    from services.responder.llm import Turn\n")
    (receiver / "near.py").write_text("from ..coalescer import service\n")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "up.py").write_text("import platforms.base\n")

    assert imports(tmp_path) == {
        ("services.receiver", "services.responder", "services/receiver/late.py"),
        ("services.receiver", "services.coalescer", "services/receiver/near.py"),
        ("shared", "platforms", "shared/up.py"),
    }

"""docs/architecture.md names every module of Relay's packages, so the map cannot drift."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("queue_core", "queue_api", "queue_admin", "relay_tasks", "relayproject", "relay_bench")


def modules() -> list[str]:
    """Every ``.py`` file of the packages, as a path from the repository root (migrations and
    package ``__init__`` files aside)."""
    found = [
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts and path.name != "__init__.py"
    ]
    return sorted(found)


def test_the_packages_have_modules() -> None:
    assert len(modules()) > 70
    assert "queue_core/service.py" in modules()


def test_architecture_doc_names_every_module() -> None:
    text = DOC.read_text()
    missing = [path for path in modules() if f"`{path}`" not in text]
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_architecture_doc_names_no_module_that_is_gone() -> None:
    text = DOC.read_text()
    named = {
        word.strip("`")
        for word in text.split()
        if word.startswith("`") and word.endswith(".py`") and "/" in word
    }
    gone = sorted(path for path in named if not (ROOT / path).exists())
    assert gone == [], f"docs/architecture.md names modules that do not exist: {gone}"

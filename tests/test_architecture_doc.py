"""docs/architecture.md lists every module of the package, and names none that is gone.

The doc's module list has one entry per module and package of ``umbp_redis/``: a line
that starts with ``- `PATH` ``, PATH relative to ``umbp_redis/`` (``store/plane.py`` for a
module, ``engine/copy/`` for a package). Elsewhere, every path the doc names in backticks
(``engine/lookups.py``, ``umbp_redis/bench/gpu_copy.py``, ``tests/test_block_copy.py``)
and every dotted module name (``umbp_redis.engine.redis_tier``) must exist. Plain file
reads and regexes: no Redis, no vLLM.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "umbp_redis"
DOC = ROOT / "docs" / "architecture.md"

# A module-list entry: a bullet at the start of a line whose first word is a backticked
# module path (``x/y.py``) or package path (``x/y/``) relative to the package.
ENTRY = re.compile(r"^[-*] `((?:[a-z0-9_]+/)*(?:[a-z0-9_]+\.py|[a-z0-9_]+/))`", re.MULTILINE)
# Any backticked file path the doc names: a ``.py`` (or other source) file.
FILE_PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_-]+\.(?:py|cu|cpp|sh))`")
# Any backticked dotted module name of the package.
DOTTED = re.compile(r"`(umbp_redis(?:\.[a-z0-9_]+)+)`")
# First path segments that name a folder of the repository rather than of the package.
REPO_FOLDERS = {"tests", "scripts", "docs", "umbp_redis"}
SKIPPED = {"__init__.py", "__main__.py"}


def package_entries() -> set[str]:
    """Every module (``room/name.py``) and package (``room/``) under ``umbp_redis/``, as
    paths relative to it (the root package itself excluded)."""
    out: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts:
            continue
        if path.name == "__init__.py":
            if rel.parent != Path("."):
                out.add(f"{rel.parent.as_posix()}/")
        elif path.name not in SKIPPED:
            out.add(rel.as_posix())
    return out


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def listed_entries(text: str) -> list[str]:
    """The module-list entries of the doc, in order."""
    return ENTRY.findall(text)


def resolve(named: str) -> Path:
    """Where a path the doc names lies: under the repository for ``tests/...``,
    ``scripts/...``, ``docs/...`` and ``umbp_redis/...``, else under the package."""
    first = named.split("/", 1)[0]
    return (ROOT / named) if first in REPO_FOLDERS else (PACKAGE / named)


def test_the_package_has_modules_to_list() -> None:
    found = package_entries()
    assert "connector.py" in found and "store/" in found, sorted(found)


def test_every_module_and_package_is_listed() -> None:
    listed = set(listed_entries(doc_text()))
    missing = sorted(package_entries() - listed)
    assert not missing, (
        "docs/architecture.md lists no entry ('- `PATH`: purpose', PATH relative to "
        f"umbp_redis/) for: {', '.join(missing)}"
    )


def test_every_listed_entry_exists() -> None:
    gone = sorted(set(listed_entries(doc_text())) - package_entries())
    assert not gone, f"docs/architecture.md lists modules that do not exist: {', '.join(gone)}"


def test_each_module_is_listed_once() -> None:
    entries = listed_entries(doc_text())
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not twice, f"docs/architecture.md lists these more than once: {', '.join(twice)}"


def test_every_named_path_exists() -> None:
    text = doc_text()
    named = set(FILE_PATH.findall(text))
    gone = sorted(n for n in named if not resolve(n).is_file())
    assert not gone, f"docs/architecture.md names files that do not exist: {', '.join(gone)}"


def test_every_named_dotted_module_exists() -> None:
    gone = []
    for dotted in sorted(set(DOTTED.findall(doc_text()))):
        base = ROOT.joinpath(*dotted.split("."))
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            gone.append(dotted)
    assert not gone, f"docs/architecture.md names modules that do not exist: {', '.join(gone)}"

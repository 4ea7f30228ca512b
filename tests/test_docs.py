"""The docs name every option, and the README opens with the two commands."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from umbp_redis.engine.options import CONNECTOR_OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_doc_lists_every_option_with_its_default() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    for opt in CONNECTOR_OPTIONS:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{opt.name}` |")), None)
        assert row is not None, f"{opt.name} is not documented"
        if opt.default is not None:
            assert str(opt.default).lower() in row.lower(), (opt.name, row)


def test_configuration_doc_is_what_its_generator_writes() -> None:
    """docs/configuration.md is edited through scripts/gen_config_doc.py, never by hand."""
    spec = importlib.util.spec_from_file_location(
        "gen_config_doc", ROOT / "scripts" / "gen_config_doc.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == gen.render(), "run: python scripts/gen_config_doc.py"


def test_readme_opens_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    commands = [ln for ln in lines[:30] if ln.startswith("./scripts/")]
    assert commands[:2] == ["./scripts/demo", "./scripts/test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci

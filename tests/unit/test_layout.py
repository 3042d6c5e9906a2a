"""The house rules of the package that a reader relies on: small modules, each saying why it exists.

The layering itself (imports run downwards, no cycles) is checked by import-linter's contracts in
pyproject.toml (`make lint-imports`, part of `make test`).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "skyrl_mtp"
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_every_module_says_why_it_exists():
    missing = [str(p.relative_to(PACKAGE)) for p in _modules() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"


def test_no_grab_bag_modules():
    assert not [p for p in _modules() if p.stem in ("utils", "util", "helpers", "misc", "common")]

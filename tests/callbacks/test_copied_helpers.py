"""Each callback file works copied on its own, so the helpers several of them need are copied into each: every copy of a
helper must stay the same, word for word."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# lit_cancel.objectives.audit's shared_positions is written differently on purpose: the tests check one against the other
HOLDERS = sorted((ROOT / "callbacks").glob("*.py"))
COPIED = ("read_contract", "shared_positions", "measuring", "StepSnapshot")


def definitions(path: Path) -> dict[str, str]:
    """The source of each top-level function and class of ``path``, by name."""
    source = path.read_text()
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def copies() -> dict[str, dict[str, str]]:
    found = defaultdict(dict)
    for path in HOLDERS:
        for name, source in definitions(path).items():
            if name in COPIED:
                found[name][str(path.relative_to(ROOT))] = source
    return found


@pytest.mark.parametrize("name", COPIED)
def test_every_copy_of_a_shared_helper_is_the_same(name):
    held = copies()[name]
    assert len(held) >= 2, f"{name} is no longer copied: take it out of COPIED"
    first, *others = held.items()
    for path, source in others:
        assert source == first[1], f"{name} in {path} differs from the copy in {first[0]}"

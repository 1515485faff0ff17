"""The experiments' package benchmarks/lab/: its import order, replay's comparison, the README's generated numbers."""

import ast
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from lab import runs  # noqa: E402

ORDER = ["stats", "runs", "summaries", "cells", "sections", "report"]  # each module may import only those before it


def lab_imports(path: Path) -> set[str]:
    """The ``lab`` modules a file imports (``from lab.x import``, ``from lab import x``, ``import lab.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "lab":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lab."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("lab.")}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            assert not any(name in ("experiments", "experiments_report", "experiments_runs") for name in names), path
    return found


def test_lab_modules_import_one_way_without_a_circle():
    modules = {path.stem: lab_imports(path) for path in (BENCHMARKS / "lab").glob("*.py") if path.stem != "__init__"}
    assert set(ORDER) | {"parts"} == set(modules)
    assert modules["parts"] == set()  # loaded by class path from lit-cancel fit; needs nothing of the rest
    for index, name in enumerate(ORDER):
        assert modules[name] <= set(ORDER[:index]), (name, modules[name])
    # and the script on top imports the package, which never imports the script back
    assert lab_imports(BENCHMARKS / "experiments.py") <= set(ORDER)


def series(*values: float, start: int = 0) -> list[list[float]]:
    return [[start + i, v] for i, v in enumerate(values)]


def test_replay_comparison_of_identical_scalars():
    stored = {"val/accuracy": series(0.25, 0.5), "health/learning_tax": series(1e-3, float("nan"), 2e-3)}
    comparison = runs.compare_scalars(stored, {tag: [list(p) for p in points] for tag, points in stored.items()})
    assert comparison["identical"] and comparison["differ"] == {} and comparison["tags"] == 2
    assert runs.describe_comparison(comparison)[0].startswith("bit-identical")


def test_replay_comparison_names_each_differing_series_and_its_first_step():
    stored = {"val/accuracy": series(0.25, 0.5), "health/learning_tax": series(1e-3, 2e-3, 3e-3, 4e-3),
              "rollout/accuracy": series(0.1, 0.2, 0.3), "only/stored": series(1.0)}
    replayed = {"val/accuracy": series(0.25, 0.5), "health/learning_tax": series(1e-3, 2e-3, 3.1e-3, 4.1e-3),
                "rollout/accuracy": series(0.1, 0.2), "only/replayed": series(1.0)}
    comparison = runs.compare_scalars(stored, replayed)
    assert not comparison["identical"]
    assert comparison["missing"] == ["only/stored"] and comparison["extra"] == ["only/replayed"]
    assert comparison["differ"] == {
        "health/learning_tax": {"first_step": 2, "stored": 3e-3, "replayed": 3.1e-3, "points": 2},
        "rollout/accuracy": {"first_step": 2, "stored": 0.3, "replayed": None, "points": 1},  # the replay stopped early
    }
    lines = runs.describe_comparison(comparison)
    assert lines[0] == "NOT identical: 2 of 4 series differ" and lines[1] == "first differing step: 2"
    assert any("only stored: only/stored" in line for line in lines)


def test_replay_comparison_counts_a_shifted_step_as_a_difference():
    comparison = runs.compare_scalars({"a": [[0, 1.0], [10, 2.0]]}, {"a": [[0, 1.0], [11, 2.0]]})
    assert comparison["differ"]["a"]["first_step"] == 10 and not comparison["identical"]


def test_the_docs_and_the_readme_quote_the_stored_json():
    """docs/experiments.md's generated part and README.md's experiment bullets are what the stored JSON gives today
    (``python benchmarks/experiments.py --report`` rewrites both)."""
    from lab import report

    results, probes = report.load_all()
    generated = "\n".join(report.generated(results, probes))
    assert generated in report.DOC.read_text(), "docs/experiments.md is stale: run python benchmarks/experiments.py --report"
    readme = report.README.read_text()
    assert "\n".join(report.readme_lines(results)) in readme, "README.md is stale: run python benchmarks/experiments.py --report"
    assert len(readme.splitlines()) <= 200


def test_every_comparison_in_a_holm_family_is_adjusted_together():
    from lab import cells, report

    results, probes = report.load_all()
    report.generated(results, probes)
    # E9's plan comparisons: five distinct ones (reward-balanced − shuffled is shown from both sides, counted once)
    e9 = cells.FAMILIES.adjusted["E9 accuracy"]
    assert len(e9) == 5 and e9[cells.pair("reward_balanced", "shuffled")] == pytest.approx(0.2185, abs=0.002)
    raw = cells.FAMILIES.raw["E9 accuracy"]
    assert min(raw.values()) == raw[cells.pair("reward_balanced", "shuffled")] == pytest.approx(0.0437, abs=0.0005)


def test_provenance_records_pip_freeze_as_a_list_of_lines():
    frozen = runs.pip_freeze()
    assert isinstance(frozen, list) and all(isinstance(line, str) and line.strip() for line in frozen)
    assert any(line.lower().startswith("torch") for line in frozen)

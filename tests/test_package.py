"""The package imports lazily: the callbacks stand alone, and every public name resolves on first use."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lit_cancel


def test_importing_the_callbacks_loads_neither_the_models_nor_the_rest_of_the_package():
    listing = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom lit_cancel.callbacks import TokenFlipMonitor\nprint('\\n'.join(sys.modules))"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout.split()
    roots = {name.split(".")[0] for name in listing}
    assert {"lightning", "torch", "torchmetrics"} <= roots
    # transformers may come with torchmetrics itself; what lit_cancel's own modules would add must not
    assert not roots & {"peft", "datasets", "jsonargparse", "safetensors"}
    ours = {name for name in listing if name.startswith("lit_cancel")}
    # lit_cancel.exports is the package's table of public names (no imports of its own)
    assert ours == {"lit_cancel", "lit_cancel.exports", "lit_cancel.callbacks", "lit_cancel.callbacks.doctor", *(f"lit_cancel.callbacks.{f}" for f in
                    ("doctor.diagnoses", "doctor.rule_book", "doctor.run_doctor", "entropy_collapse", "learning_tax", "rollout_samples",
                     "solution_drift", "token_flip"))}


def test_every_public_name_resolves_and_is_listed():
    for name in lit_cancel.__all__:
        value = getattr(lit_cancel, name)
        assert isinstance(value, dict) if name == "PRESETS" else value.__name__ == name
    assert set(lit_cancel.__all__) <= set(dir(lit_cancel))
    for base in ["AdvantageEstimator", "Clip", "Normaliser", "GroupTransform", "MiniBatchPlan", "Objective"]:
        assert base in lit_cancel.__all__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        lit_cancel.NoSuchThing  # noqa: B018 (the lookup itself is under test)


def test_the_wheel_ships_the_models_and_builds_without_a_packaging_warning(tmp_path):
    root = Path(__file__).parents[1]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(root)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert "BuildBackendWarning" not in built.stderr and "DeprecationWarning" not in built.stderr, built.stderr
    (wheel,) = tmp_path.glob("lit_cancel-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {name for name in names if name.startswith("lit_cancel/assets/")}
    expected = {f"lit_cancel/{path.relative_to(root / 'lit_cancel').as_posix()}" for path in (root / "lit_cancel" / "assets").glob("*/*")}
    assert shipped == expected and len(expected) == 15  # three models, five files each
    # every module of every sub-package, the callbacks' folder installed as lit_cancel/callbacks
    sources = {f"lit_cancel/{path.relative_to(root / 'lit_cancel').as_posix()}" for path in (root / "lit_cancel").rglob("*.py")}
    sources |= {f"lit_cancel/callbacks/{path.relative_to(root / 'callbacks').as_posix()}" for path in (root / "callbacks").rglob("*.py")}
    assert sources - names == set()

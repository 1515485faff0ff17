"""E11's report section: read from run files, its numbers against hand-computed ones, its verdicts through the same
checks as the rest of docs/experiments.md (tests/study/test_verdict_wording.py)."""

import hashlib
import json
import math
import statistics

import pytest
from lab import sections_e11
from lab.cells import FAMILIES
from lab.report import e11_readme_lines
from lab.sections_e11 import e11_section, manipulation_lines
from lab.summaries import load_e11
from test_verdict_wording import generated_problems, readme_problems

SEEDS = range(10)


def scalars(tax: float, accuracy: float, agreement: float, entropy: float, start: tuple[float, float] = (0.5, 0.4)
            ) -> dict[str, list[list[float]]]:
    """A run's logged series: the tax at ``tax`` over steps 0-9 and twice that after, the entropy at ``start[0]`` until
    step 34 and ``entropy`` after, validation at ``start[1]`` before and ``accuracy`` after."""
    steps = range(40)
    return {
        "health/learning_tax": [[s, tax if s < 10 else 2 * tax] for s in steps],
        "health/entropy_mean": [[s, entropy if s >= 35 else start[0]] for s in steps],
        "rollout/first_turn_agreement": [[s, agreement if s == 0 else 0.5] for s in steps],
        "rollout/shared_policy_tokens": [[s, agreement / 2] for s in steps],
        "rollout/tool_calls": [[s, 0.9] for s in steps],
        "val/accuracy": [[0, start[1]], [40, accuracy]],
    }


def warm_start(setting: str, seed: int) -> tuple[float, float]:
    """A warm start's step-0 entropy and held-out success: the agreeing one surer (0.1 against 0.5, SDs 0.01 and 0.02)
    and more successful (0.7 against 0.4, SD 0.01 each), as E11's were."""
    sign = 1 if seed % 2 else -1  # seeds 0-9: mean 0, SD sqrt(10/9) of one step
    if setting.startswith("agreeing"):
        return 0.1 + sign * 0.01, 0.7 + sign * 0.01
    return 0.5 + sign * 0.02, 0.4 + sign * 0.01


def accuracy_offset(seed: int) -> float:
    """GRPO's accuracy above the other arms': -0.02 to 0.02, mean 0 over seeds 0-9."""
    return 0.01 * ((7 * seed) % 5 - 2)


def write_runs(folder, taxes: dict) -> None:
    """Every E11 run; GRPO pays ``taxes[setting](seed)``, the others 0; the agreeing warm start's step 0 has 4 or 5 of 16
    groups agree, the mixed one's none."""
    for setting in ("agreeing-tool95", "mixed-tool50"):
        for seed in SEEDS:
            for arm in ("GRPO", "DrGRPO", "DFPOMin"):
                tax = taxes[setting](seed) if arm == "GRPO" else 0.0
                accuracy = 0.7 + 0.01 * seed + (accuracy_offset(seed) if arm == "GRPO" else 0.0)
                agreement = (4 + seed % 2) / 16 if setting.startswith("agreeing") else 0.0
                entropy = 0.1 + 0.001 * seed + {"DrGRPO": 0.01, "GRPO": 0.001 * (seed % 3)}.get(arm, 0.0)
                record = {"experiment": "E11", "arm": arm, "setting": setting, "seed": seed, "wall_s": 100.0,
                          "provenance": {"commit": "c0ffee" * 7, "cpu": "test CPU"},
                          "scalars": scalars(tax, accuracy, agreement, entropy, warm_start(setting, seed))}
                (folder / f"{arm}-{setting}-seed{seed}.json").write_text(json.dumps(record))


def rendered(runs: dict) -> str:
    FAMILIES.reset()
    e11_section(runs)
    FAMILIES.close()
    return "\n".join(e11_section(runs))


def grpo_tax(setting: str):
    return (lambda seed: 0.01 + 0.001 * seed) if setting == "agreeing" else (lambda seed: 0.008 + 0.0013 * (seed % 4))


@pytest.fixture
def report(tmp_path, monkeypatch):
    monkeypatch.setattr(sections_e11, "RESULTS", tmp_path)
    write_runs(tmp_path, {"agreeing-tool95": grpo_tax("agreeing"), "mixed-tool50": grpo_tax("mixed")})
    return rendered(load_e11(tmp_path))


def row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [column.strip() for column in line.strip().strip("|").split("|")]


def test_the_primary_rows_hold_the_hand_computed_differences_and_their_verdicts(report):
    # GRPO's tax over 40 steps: 10 steps at t, 30 at 2t, so 1.75 t; DFPOMin pays 0
    agreeing = [1.75 * grpo_tax("agreeing")(seed) for seed in SEEDS]
    mixed = [1.75 * grpo_tax("mixed")(seed) for seed in SEEDS]
    p1 = row(report, "| E11 P1")
    assert p1[3].startswith(f"{statistics.fmean(agreeing):.4f} ± ") and p1[9] == "**effect, the predicted direction**"
    p2 = row(report, "| E11 P2")
    assert p2[2].startswith("10 + 10 (Welch df ")
    assert p2[3].startswith(f"{statistics.fmean(agreeing) - statistics.fmean(mixed):.4f} ± ")
    assert p2[4] == f"{statistics.stdev(agreeing):.4f} / {statistics.stdev(mixed):.4f}"
    p3 = row(report, "| E11 P3")  # GRPO − DFPOMin accuracy: mean 0, SD 0.015, so its 90% interval is inside ±0.04
    offsets = [accuracy_offset(seed) for seed in SEEDS]
    assert float(p3[3].split(" ± ")[0]) == pytest.approx(statistics.fmean(offsets), abs=1e-3)
    assert float(p3[4]) == pytest.approx(statistics.stdev(offsets), abs=1e-3)
    assert p3[8].endswith("(±0.04)") and p3[9] == "**no difference larger than 0.04**"


def test_every_verdict_of_the_section_passes_the_report_checks(report):
    problems, checked = generated_problems(report)
    assert not problems, "\n".join(problems)
    assert checked == 3 + 8 + 2 + 2  # the primary rows, S1 and S2's cells, S3's two, S4 and S5's Welch cells


def test_the_checks_catch_a_wrong_e11_verdict(report):
    wrong = report.replace("**effect, the predicted direction**", "**inconclusive**", 1)
    assert any("E11 P1" in problem for problem in generated_problems(wrong)[0])
    welch = next(line for line in report.splitlines() if line.startswith("* S5"))
    assert "(effect;" in welch and generated_problems(welch.replace("(effect;", "(inconclusive;"))[0]


def test_p2s_confound_gives_the_warm_starts_step_zero_differences_in_within_warm_start_sds(report):
    # entropy 0.1 against 0.5, SDs 0.01 and 0.02 times sqrt(10/9); success 0.7 against 0.4, SD 0.01 sqrt(10/9) in each
    entropy = 0.4 / math.sqrt((0.01**2 + 0.02**2) / 2 * 10 / 9)
    success = 0.3 / (0.01 * math.sqrt(10 / 9))
    assert (f"the agreeing one against the mixed one: entropy (`health/entropy_mean`) 0.100 against 0.500, {entropy:.1f} "
            f"within-warm-start SDs apart; held-out success (`val/accuracy`) 0.700 against 0.400, {success:.1f} "
            "within-warm-start SDs apart. P2's difference is what the two warm starts give, not agreement alone.") in report


def test_p2s_confound_without_spread_within_a_warm_start(tmp_path):
    runs = {seed: {"entropy_start": 0.1, "val_start": 0.7} for seed in SEEDS}
    others = {seed: {"entropy_start": 0.5, "val_start": 0.4} for seed in SEEDS}
    line = sections_e11.confound_line({"GRPO": runs}, {"GRPO": others})
    assert "0.100 against 0.500, no spread within either warm start" in line
    assert sections_e11.confound_line({"GRPO": {0: runs[0]}}, {"GRPO": others}).endswith("not both warm starts have two runs yet.")


def test_the_manipulation_check_pools_step_zero_over_the_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(sections_e11, "RESULTS", tmp_path)
    write_runs(tmp_path, {"agreeing-tool95": grpo_tax("agreeing"), "mixed-tool50": grpo_tax("mixed")})
    runs = load_e11(tmp_path)
    agreeing = {arm: runs[(arm, "agreeing-tool95")] for arm in ("GRPO", "DrGRPO", "DFPOMin")}
    mixed = {arm: runs[(arm, "mixed-tool50")] for arm in ("GRPO", "DrGRPO", "DFPOMin")}
    (line,) = manipulation_lines(agreeing, mixed)
    assert "agreeing 45 of 160 (0.281); mixed 0 of 160 (0.000): **the manipulation holds**" in line  # 5 × 4 + 5 × 5
    assert line.endswith("agreeing: the same in every arm at every seed; mixed: the same in every arm at every seed.")
    agreeing["DrGRPO"][3] = {**agreeing["DrGRPO"][3], "agreement_start": 0.0}
    (line,) = manipulation_lines(mixed, agreeing)  # swapped: the "agreeing" side now agrees less
    assert "**the manipulation does not hold**: P2 does not test its question" in line and "NOT the same at seeds 3" in line


def test_a_bug_in_a_cancelling_arm_and_a_warm_start_other_than_the_shipped_model_are_reported(tmp_path, monkeypatch, report):
    assert "`DFPOMin` 0.0e+00 over 20 runs: 0 up to float rounding" in report
    assert "* agreeing: not trained yet." in report
    monkeypatch.setattr(sections_e11, "RESULTS", tmp_path)
    shipped = hashlib.sha256(sections_e11.SHIPPED_WEIGHTS.read_bytes()).hexdigest()
    for name, share, weights in (("mixed-tool50", 0.5, shipped), ("agreeing-tool95", 0.95, "0" * 64)):
        (tmp_path / "E11").mkdir(exist_ok=True)
        (tmp_path / "E11" / f"warmstart-{name}.json").write_text(json.dumps({
            "tool_share": share, "wall_s": 600.0, "model_sha256": weights, "provenance": {"commit": "abcdef0123"},
            "scalars": {"val/accuracy": [[100, 0.3], [400, 0.69]]}}))
    lines = sections_e11.warm_start_lines()
    assert lines[0].startswith("* mixed (tool share 0.5): 600 s, held-out success after training 0.690") and \
        "(the shipped model's weights bit for bit)" in lines[0]
    assert "(NOT the shipped weights)" in lines[1]
    write_runs(tmp_path, {"agreeing-tool95": grpo_tax("agreeing"), "mixed-tool50": grpo_tax("mixed")})
    record = json.loads((tmp_path / "DFPOMin-mixed-tool50-seed2.json").read_text())
    record["scalars"]["health/learning_tax"][7][1] = 3e-4
    (tmp_path / "DFPOMin-mixed-tool50-seed2.json").write_text(json.dumps(record))
    assert "`DFPOMin` 3.0e-04 over 20 runs: ABOVE 1e-06, a bug to report" in sections_e11.identity_line(load_e11(tmp_path))


def test_the_readme_bullet_quotes_the_primary_tests_with_their_verdicts(tmp_path, monkeypatch):
    monkeypatch.setattr(sections_e11, "RESULTS", tmp_path)
    write_runs(tmp_path, {"agreeing-tool95": grpo_tax("agreeing"), "mixed-tool50": grpo_tax("mixed")})
    runs = load_e11(tmp_path)
    rendered(runs)  # fills the Holm families the bullet quotes
    bullet = "\n".join(e11_readme_lines(runs))
    problems, checked = readme_problems(bullet)
    assert not problems and checked == 3, problems
    tax = statistics.fmean(1.75 * grpo_tax("agreeing")(seed) for seed in SEEDS)
    assert f"GRPO leaves {tax:.4f} ± " in bullet and "DFPOMin ≤ 0e+00" in bullet
    # P2 compares two warm starts, not two levels of agreement; P3 was tested from one of them
    assert ("from the warm start whose groups' first turns agree more often (which also starts surer and more successful: "
            "entropy 0.10 against 0.50, success 0.70 against 0.40), ") in bullet
    assert "; from that warm start, success GRPO − DFPOMin " in bullet and "where first turns agree" not in bullet
    assert "TOST ±0.04 p" in bullet and bullet.endswith(": no difference larger than 0.04).")
    assert e11_readme_lines({}) == []

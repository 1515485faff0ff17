"""E12's report section on hand-built runs: its tests against scipy, its verdicts and combined readings as pre-registered,
the manipulation and identity checks, and the check before the main runs (E12P)."""

import json
import math
import statistics

import pytest
from lab import sections_e12, summaries
from lab.cells import FAMILIES, format_p, seed_ranges
from lab.sections import experiment_sections
from lab.sections_e12 import READINGS, e12_readme_lines, e12_results, e12_section, forcing_works
from lab.summaries import load_e12
from scipy import stats
from test_verdict_wording import generated_problems, readme_problems

SEEDS = range(200, 226)
DFPO_SEEDS = range(200, 205)
SETTINGS = {"agreeing": "agreeing-tool95", "mixed": "mixed-tool50"}
STEPS = 40
OUTCOMES = {"P": "health/learning_tax", "S1": "val/accuracy", "S2": "health/entropy_mean"}


def zigzag(seed: int) -> int:
    """+1, −1, +1, …: over seeds 200-225, mean 0 and SD √(26/25)."""
    return 1 if seed % 2 == 0 else -1


def differences(mean: float, spread: float, seeds=SEEDS) -> dict[int, float]:
    """forced − independent at each seed: ``mean ± spread``, alternating."""
    return {seed: mean + spread * zigzag(seed) for seed in seeds}


def record(arm: str, setting: str, seed: int, tax: float, accuracy: float, entropy: float, shared: float,
           agreement: float, steps: int = STEPS) -> dict:
    """A run's JSON: the tax, entropy, agreement and shared tokens constant over the steps (so their means are the values),
    validation before training and after the last step."""
    def constant(value: float) -> list[list[float]]:
        return [[step, value] for step in range(steps)]

    return {"experiment": "E12", "arm": arm, "setting": setting, "seed": seed, "wall_s": 100.0,
            "provenance": {"commit": "c0ffee" * 7, "cpu": "test CPU"},
            "scalars": {"health/learning_tax": constant(tax), "health/entropy_mean": constant(entropy),
                        "rollout/first_turn_agreement": constant(agreement), "rollout/shared_policy_tokens": constant(shared),
                        "rollout/tool_calls": constant(0.9), "rollout/turns": constant(1.9),
                        "val/accuracy": [[0, 0.5], [steps, accuracy]],
                        **({"rollout/forced_final_first_turn": constant(0.1)} if arm.endswith("-forced") else {})}}


def independent_values(seed: int) -> dict[str, float]:
    """``GRPO-independent``'s outcomes, varying with the seed as the prompts do."""
    return {"P": 0.02 + 0.0005 * (seed % 3), "S1": 0.6 + 0.01 * (seed % 4), "S2": 0.1 + 0.001 * (seed % 5)}


def write_runs(folder, plan: dict[str, dict[str, dict[int, float]]], independent_seeds=SEEDS) -> None:
    """Every E12 run: at each warm start ``GRPO-forced`` is ``GRPO-independent`` plus ``plan[warm start][outcome][seed]``;
    the forced arms agree at every step and share 0.9 of the policy's tokens (± 0.02) against the independent arm's 0.5;
    ``DFPOMin-forced`` pays no tax and has ``GRPO-forced``'s step-0 episodes."""
    for warm_start, setting in SETTINGS.items():
        for seed in SEEDS:
            base = independent_values(seed)
            forced = {name: base[name] + plan[warm_start][name][seed] for name in OUTCOMES}
            shared = 0.9 + 0.02 * zigzag(seed)
            runs = {"GRPO-forced": record("GRPO-forced", setting, seed, forced["P"], forced["S1"], forced["S2"], shared, 1.0)}
            if seed in independent_seeds:
                runs["GRPO-independent"] = record("GRPO-independent", setting, seed, base["P"], base["S1"], base["S2"], 0.5, 0.4)
            if seed in DFPO_SEEDS:
                runs["DFPOMin-forced"] = record("DFPOMin-forced", setting, seed, 0.0, forced["S1"], forced["S2"], shared, 1.0)
            for arm, run in runs.items():
                (folder / f"{arm}-{setting}-seed{seed}.json").write_text(json.dumps(run))


def rendered(runs: dict, pilot: dict | None = None) -> str:
    FAMILIES.reset()
    e12_section(runs, pilot)
    FAMILIES.close()
    return "\n".join(e12_section(runs, pilot))


def by_hand(values: list[float], margin: float) -> tuple[float, float]:
    """``(p, TOST p)`` of paired differences, from scipy's t distribution."""
    n, mean, sd = len(values), statistics.fmean(values), statistics.stdev(values)
    se = sd / math.sqrt(n)
    p = 2 * stats.t.sf(abs(mean) / se, n - 1)
    p_tost = max(stats.t.sf((mean + margin) / se, n - 1), stats.t.cdf((mean - margin) / se, n - 1))
    return p, p_tost


def holm_of_two(first: float, second: float) -> tuple[float, float]:
    low, high = sorted((first, second))
    adjusted = {low: min(1.0, 2 * low)}
    adjusted[high] = max(adjusted[low], min(1.0, high))
    return adjusted[first], adjusted[second]


MARGINS = {"P": 0.002, "S1": 0.04, "S2": 0.01}
EFFECT, WITHIN, UNCLEAR = (0.004, 0.001), (0.0, 0.001), (0.001, 0.004)  # tax differences: mean, spread
UNMOVED = {"S1": (0.0, 0.01), "S2": (0.0, 0.002)}  # 90% intervals well inside ±0.04 and ±0.01
PLANS = {  # (agreeing, mixed): which of the four pre-registered readings each warm start gives
    "raises, does not raise": ({"P": EFFECT, **UNMOVED}, {"P": WITHIN, **UNMOVED}),
    "not isolated, open": ({"P": EFFECT, "S1": (0.1, 0.01), "S2": UNMOVED["S2"]}, {"P": UNCLEAR, **UNMOVED}),
}
EXPECTED = {"raises, does not raise": (READINGS[0], READINGS[2]), "not isolated, open": (READINGS[1], READINGS[3])}
VERDICTS = {  # (outcome, warm start) -> the pre-registered verdict, from the numbers above
    "raises, does not raise": {("P", "agreeing"): "effect, the predicted direction", ("P", "mixed"): "no difference larger than 0.002",
                               ("S1", "agreeing"): "no difference larger than 0.04", ("S2", "mixed"): "no difference larger than 0.01"},
    "not isolated, open": {("P", "agreeing"): "effect, the predicted direction", ("P", "mixed"): "inconclusive",
                           ("S1", "agreeing"): "effect", ("S1", "mixed"): "no difference larger than 0.04"},
}


def plan_of(name: str) -> dict[str, dict[str, dict[int, float]]]:
    return {warm_start: {outcome: differences(*chosen[outcome]) for outcome in OUTCOMES}
            for warm_start, chosen in zip(SETTINGS, PLANS[name])}


@pytest.mark.parametrize("name", list(PLANS))
def test_each_combined_reading_follows_from_tests_that_match_scipy(tmp_path, name):
    plan = plan_of(name)
    write_runs(tmp_path, plan)
    runs = load_e12(tmp_path)
    text = rendered(runs)
    results = e12_results(runs)
    for outcome, margin in MARGINS.items():
        raw = {warm_start: by_hand(list(plan[warm_start][outcome].values()), margin) for warm_start in SETTINGS}
        holm = dict(zip(SETTINGS, holm_of_two(*(raw[w][0] for w in SETTINGS))))
        holm_tost = dict(zip(SETTINGS, holm_of_two(*(raw[w][1] for w in SETTINGS))))
        for warm_start in SETTINGS:
            result = results[(outcome, warm_start)]
            assert result.n == 26
            assert result.mean == pytest.approx(statistics.fmean(plan[warm_start][outcome].values()), abs=1e-9)
            assert result.sd == pytest.approx(statistics.stdev(plan[warm_start][outcome].values()), rel=1e-6)
            assert result.p == pytest.approx(raw[warm_start][0], rel=1e-6, abs=1e-300)
            assert result.holm == pytest.approx(holm[warm_start], rel=1e-6, abs=1e-300)
            assert result.p_tost == pytest.approx(raw[warm_start][1], rel=1e-6, abs=1e-300)
            assert result.holm_tost == pytest.approx(holm_tost[warm_start], rel=1e-6, abs=1e-300)
    for (outcome, warm_start), verdict in VERDICTS[name].items():
        assert results[(outcome, warm_start)].verdict == verdict
    agreeing, mixed = EXPECTED[name]
    assert f"**{agreeing}** there." in text.split("* agreeing: P1 ")[1].splitlines()[0]
    assert f"**{mixed}** there." in text.split("* mixed: P2 ")[1].splitlines()[0]
    problems, checked = generated_problems(text)
    assert not problems, "\n".join(problems)
    assert checked == 6  # P1, P2 and the two warm starts' S1 and S2


def test_the_mde_at_holms_strictest_level_is_the_preregistered_formula(tmp_path):
    plan = plan_of("not isolated, open")
    write_runs(tmp_path, plan)
    result = e12_results(load_e12(tmp_path))[("P", "mixed")]
    sd = statistics.stdev(plan["mixed"]["P"].values())
    # (t_0.9875,n−1 + t_0.80,n−1)/√n × SD_d, as the pre-registration sized its seeds
    assert result.detectable(0.025) == pytest.approx((stats.t.ppf(0.9875, 25) + stats.t.ppf(0.8, 25)) / math.sqrt(26) * sd, rel=1e-6)
    assert result.detectable(0.05) == pytest.approx((stats.t.ppf(0.975, 25) + stats.t.ppf(0.8, 25)) / math.sqrt(26) * sd, rel=1e-6)


def test_the_checks_catch_a_wrong_e12_verdict(tmp_path):
    write_runs(tmp_path, plan_of("raises, does not raise"))
    text = rendered(load_e12(tmp_path))
    assert not generated_problems(text)[0]
    for right, wrong in (("**effect, the predicted direction**", "**effect, against the predicted direction**"),
                         ("**no difference larger than 0.002**", "**inconclusive**")):
        problems = generated_problems(text.replace(right, wrong, 1))[0]
        assert len(problems) == 1 and problems[0].startswith("| E12 P"), problems


def test_a_forced_run_that_does_not_agree_at_one_step_breaks_the_manipulation_and_that_reading(tmp_path):
    write_runs(tmp_path, plan_of("raises, does not raise"))
    path = tmp_path / "GRPO-forced-agreeing-tool95-seed207.json"
    run = json.loads(path.read_text())
    run["scalars"]["rollout/first_turn_agreement"][12][1] = 0.9
    path.write_text(json.dumps(run))
    text = rendered(load_e12(tmp_path))
    agreeing = next(line for line in text.splitlines() if line.startswith("* agreeing: the policy's tokens"))
    assert "1 at every step of 30 of 31 forced runs (not: `GRPO-forced` seed 207 (steps 12))" in agreeing
    assert agreeing.endswith("**the manipulation does not hold**: P1 does not test its question.")
    assert next(line for line in text.splitlines() if line.startswith("* mixed: the policy's tokens")).endswith(
        "**the manipulation holds**.")
    # P1 is still an effect the predicted way and S1, S2 unmoved, but without the manipulation the question stays open
    assert "* agreeing: P1 \"effect, the predicted direction\", the manipulation does not hold" in text
    assert "the question is **open** there." in text.split("* agreeing: P1 ")[1].splitlines()[0]


def test_the_identity_checks_flag_a_dfpomin_tax_and_different_step_zero_episodes(tmp_path):
    write_runs(tmp_path, plan_of("raises, does not raise"))
    text = rendered(load_e12(tmp_path))
    assert "its largest absolute value at any step of its 10 runs: 0.0e+00: 0 up to float rounding (≤ 1e-06)" in text
    assert "`GRPO-forced` and `DFPOMin-forced` at the same seed (5 seeds): the same at every seed." in text
    path = tmp_path / "DFPOMin-forced-mixed-tool50-seed202.json"
    run = json.loads(path.read_text())
    run["scalars"]["health/learning_tax"][30][1] = 1e-3
    run["scalars"]["rollout/shared_policy_tokens"][0][1] = 0.3
    path.write_text(json.dumps(run))
    text = rendered(load_e12(tmp_path))
    assert "10 runs: 1.0e-03: ABOVE 1e-06 (mixed seed 202), a bug to report, not a result." in text
    mixed = next(line for line in text.splitlines() if line.startswith("* mixed: step-0"))
    assert mixed.endswith("(5 seeds): NOT the same at seeds 202.")


def test_fewer_than_five_pairs_are_inconclusive_whatever_the_test_says(tmp_path):
    write_runs(tmp_path, plan_of("raises, does not raise"), independent_seeds=range(200, 204))
    runs = load_e12(tmp_path)
    text = rendered(runs)
    result = e12_results(runs)[("P", "agreeing")]
    assert result.n == 4 and result.holm < 0.05 and result.verdict == "inconclusive"
    assert all(result.verdict == "inconclusive" for result in e12_results(runs).values())
    assert text.count("the question is **open** there.") == 2
    assert "missing: `GRPO-independent` agreeing seeds 204–225; `GRPO-independent` mixed seeds 204–225" in text
    assert not generated_problems(text)[0]


def pilot_runs(folder, agreement: dict[str, list[float]], shared: dict[str, float]) -> dict:
    """E12P's four runs, 4 steps without validation: the forced run's agreement per step and shared tokens per warm start,
    the independent run's 0.4 and 0.5."""
    folder.mkdir(parents=True)
    for warm_start, setting in SETTINGS.items():
        for arm in ("GRPO-forced", "GRPO-independent"):
            run = record(arm, setting, 1000, 0.01, math.nan, 0.1, 0.5, 0.4, steps=4)
            run["experiment"], run["scalars"]["val/accuracy"] = "E12P", []
            if arm == "GRPO-forced":
                run["scalars"]["rollout/first_turn_agreement"] = [[step, value] for step, value in enumerate(agreement[warm_start])]
                run["scalars"]["rollout/shared_policy_tokens"] = [[step, shared[warm_start]] for step in range(4)]
            (folder / f"{arm}-{setting}-seed1000.json").write_text(json.dumps(run))
    return summaries.load(folder.parent)["E12P"]


def test_the_check_before_the_main_runs_says_where_the_forcing_works(tmp_path):
    pilot = pilot_runs(tmp_path / "E12P", {"agreeing": [1.0] * 4, "mixed": [1.0, 1.0, 0.75, 1.0]},
                       {"agreeing": 0.9, "mixed": 0.8})
    assert forcing_works(pilot) == {"agreeing": True, "mixed": False}
    text = rendered({}, pilot)
    assert ("* agreeing: the forced run's first turns agree at every step (4 steps); policy tokens the group shares 0.900 "
            "against 0.500: **the forcing works**.") in text
    assert ("* mixed: the forced run's first turns do NOT agree at every step (not at steps 2); policy tokens the group "
            "shares 0.800 against 0.500: **the forcing does not work**: the study stops here.") in text
    assert text.endswith("No main runs stored yet.")
    # sharing less than the independent run fails it too, agreement or not
    assert forcing_works(pilot_runs(tmp_path / "other" / "E12P", {"agreeing": [1.0] * 4, "mixed": [1.0] * 4},
                                    {"agreeing": 0.4, "mixed": 0.9})) == {"agreeing": False, "mixed": True}
    del pilot[("GRPO-independent", "mixed-tool50")]
    assert forcing_works(pilot)["mixed"] is None and "* mixed: not both runs stored." in rendered({}, pilot)


def test_the_report_has_no_e12_section_until_a_run_is_stored(tmp_path):
    assert not any(line.startswith("#### E12") for line in experiment_sections({}, {}))
    pilot = pilot_runs(tmp_path / "E12P", {"agreeing": [1.0] * 4, "mixed": [1.0] * 4}, {"agreeing": 0.9, "mixed": 0.9})
    lines = experiment_sections({"E12P": pilot}, {})
    assert any(line.startswith("#### E12") for line in lines) and "No main runs stored yet." in lines
    assert e12_section({})[-1] == "No main runs stored yet."


def test_the_report_says_whether_every_run_started_from_e11s_warm_start_weights(tmp_path):
    write_runs(tmp_path, plan_of("raises, does not raise"))
    for path in tmp_path.glob("*.json"):
        run = json.loads(path.read_text())
        run["model_sha256"] = "a" * 64 if "agreeing" in path.name else "m" * 64
        path.write_text(json.dumps(run))
    arms = sections_e12._arms(load_e12(tmp_path))
    e11 = {"agreeing": "a" * 64, "mixed": "m" * 64}
    assert sections_e12.warm_start_lines(arms, e11.get) == [
        "* agreeing: the warm start's weights of its 57 runs against E11's: E11's weights.",
        "* mixed: the warm start's weights of its 57 runs against E11's: E11's weights.",
    ]
    path = tmp_path / "GRPO-independent-mixed-tool50-seed207.json"
    run = json.loads(path.read_text())
    run["model_sha256"] = "r" * 64  # rebuilt on another machine: other weights
    path.write_text(json.dumps(run))
    arms = sections_e12._arms(load_e12(tmp_path))
    assert sections_e12.warm_start_lines(arms, e11.get)[1].endswith("against E11's: NOT E11's weights at seeds 207.")
    assert sections_e12.warm_start_lines(arms, lambda warm_start: None)[0].endswith("E11's record of its weights is missing: not compared.")
    # the stored E11 records are what the report compares with by default
    assert all(len(sections_e12.e11_warm_start_sha256(warm_start)) == 64 for warm_start in ("agreeing", "mixed"))


def test_the_runner_stores_the_sha256_of_the_warm_start_a_run_starts_from(tmp_path, monkeypatch):
    import hashlib

    from lab import runs

    monkeypatch.setattr(runs, "ROOT", tmp_path)
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "model.safetensors").write_bytes(b"weights")
    assert runs.model_sha256("lit-cancel fit --model.init_args.model_path=warm --seed_everything=1") == \
        hashlib.sha256(b"weights").hexdigest()
    assert runs.model_sha256("lit-cancel fit --model.init_args.model_path=embedded:tiny-agent") is None
    assert runs.model_sha256("lit-cancel fit --config configs/quickstart-agent.yaml") is None


def test_the_robustness_lines_give_medians_signs_and_leave_one_out_ps_that_match_scipy_and_name_fragile_seeds(tmp_path):
    plan = plan_of("raises, does not raise")
    # P from the agreeing warm start: an effect (raw p 0.018) that seed 207, far above the others, helps carry; leaving
    # out any one of the even seeds (the others' high values) takes its p to 0.025 or above
    plan["agreeing"]["P"] = {seed: (0.004 if seed == 207 else 0.0003 + 0.0006 * zigzag(seed)) for seed in SEEDS}
    write_runs(tmp_path, plan)
    runs = load_e12(tmp_path)
    text = rendered(runs)
    lines = [line for line in text.splitlines() if line.startswith(("* P1 (", "* P2 (", "* S1 (", "* S2 ("))]
    assert len(lines) == 6
    agreeing, mixed = (next(line for line in lines if line.startswith(f"* {tag} (")) for tag in ("P1", "P2"))
    values = [plan["agreeing"]["P"][seed] for seed in SEEDS]
    above = sum(value > 0 for value in values)
    left_out_p = [stats.ttest_1samp(values[:i] + values[i + 1:], 0).pvalue for i in range(len(values))]
    assert e12_results(runs)[("P", "agreeing")].verdict == "effect, the predicted direction"
    assert f"median {statistics.median(values):+.4f} (mean {statistics.fmean(values):+.4f})" in agreeing
    assert f"{above} of 26 seeds above 0 (sign p {format_p(stats.binomtest(above, 26).pvalue)})" in agreeing
    assert f"p {format_p(min(left_out_p))}–{format_p(max(left_out_p))}" in agreeing
    fragile = [seed for seed, p in zip(SEEDS, left_out_p) if p >= 0.025]
    assert fragile == list(range(200, 226, 2))
    assert f"the effect's p is 0.025 or above without seed {seed_ranges(fragile)}: fragile" in agreeing
    # the mixed warm start's P is within ±0.002 whichever seed is left out
    assert mixed.endswith("the TOST p stays below 0.025 whichever seed is left out")


@pytest.mark.parametrize("name", list(PLANS))
def test_the_readme_bullet_gives_each_warm_starts_tests_and_the_preregistered_reading(tmp_path, name):
    write_runs(tmp_path, plan_of(name))
    runs = load_e12(tmp_path)
    rendered(runs)  # fills the Holm families, as the report does before README's bullets
    lines = e12_readme_lines(runs)
    results = e12_results(runs)
    bullet = "\n".join(lines)
    assert len(lines) == 2 and lines[0].startswith("* **Agreement itself (E12, pre-registered, 26 seeds a warm start)**")
    for (outcome, warm_start), verdict in VERDICTS[name].items():
        result = results[(outcome, warm_start)]
        assert f"Holm p {format_p(result.holm)}, TOST ±{MARGINS[outcome]:g} Holm p {format_p(result.holm_tost)}: {verdict})" in bullet
    agreeing, mixed = EXPECTED[name]
    assert bullet.endswith(f"the reading is agreeing: {agreeing}, mixed: {mixed}.")
    problems, checked = readme_problems(bullet)
    assert not problems, "\n".join(problems)
    assert checked == 6


def test_the_readme_bullet_waits_for_five_pairs_at_each_warm_start(tmp_path):
    write_runs(tmp_path, plan_of("raises, does not raise"), independent_seeds=range(200, 204))
    runs = load_e12(tmp_path)
    rendered(runs)
    assert e12_readme_lines(runs) == []

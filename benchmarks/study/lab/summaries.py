"""Each stored run's numbers: what the report compares, read from the TensorBoard scalars in its JSON.

``load()`` gives ``experiment -> (arm, setting) -> seed -> summary`` (E10's, E11's and E12's with their own numbers);
the helpers below derive the quantities that need more than one scalar (steps to a threshold, drift at matched movement, token
flips at equal confidence). ``lab.sections`` turns them into tables.
"""

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from lab.runs import E10_SETTING, RESULTS

FLIP_SPLITS = ("positive", "negative", "shared", "specific", "positive_specific", "negative_specific")
FLIP_TAGS = [f"health/flip_{kind}_{part}" for part in FLIP_SPLITS for kind in ("boosted", "suppressed", "mean_abs_change")]
THRESHOLD_GAIN = 0.10  # steps to threshold: until the 10-step mean training accuracy is 0.10 above its first 5 steps
CONFIDENCE_BINS = ("p0-0.5", "p0.5-0.9", "p0.9-0.99", "p0.99-1")  # TokenFlipMonitor's default bins
BINNED_SPLITS = ("shared", "specific", "both_signs", "one_sign")


def _values(record: dict, tag: str) -> list[float]:
    return [value for _, value in record["scalars"].get(tag, [])]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def steps_to_threshold(steps: list[int], accuracy: list[float], gain: float = THRESHOLD_GAIN, window: int = 10) -> int | None:
    """The first step at which the ``window``-step mean of ``accuracy`` is ``gain`` above the mean of its first 5 values."""
    if len(accuracy) < window:
        return None
    start = statistics.fmean(accuracy[:5])
    for end in range(window, len(accuracy) + 1):
        if statistics.fmean(accuracy[end - window : end]) >= start + gain:
            return steps[end - 1] + 1
    return None


def _last(record: dict, tag: str, count: int = 1) -> float:
    values = _values(record, tag)[-count:]
    return statistics.fmean(values) if values else math.nan


def summary(record: dict) -> dict:
    """The per-run numbers the tables compare (and two series for comparisons at matched movement)."""
    validation = _values(record, "val/accuracy")
    rollout = record["scalars"].get("rollout/accuracy", [])
    reached = steps_to_threshold([int(s) for s, _ in rollout], [v for _, v in rollout])
    numbers = {
        "val_start": validation[0] if validation else math.nan,
        "val_end": validation[-1] if validation else math.nan,
        "tax": _mean(_values(record, "health/learning_tax")),
        "tax_max": max(_values(record, "health/learning_tax"), default=math.nan),
        "shared_kl": _mean(_values(record, "health/shared_kl")),
        "entropy_ratio": (_values(record, "health/entropy_ratio") or [math.nan])[-1],
        "preference_entropy": (_values(record, "health/drift_preference_entropy") or [math.nan])[-1],
        "completion_len": _mean(_values(record, "rollout/completion_len")),
        "groups_split": _mean(_values(record, "batch/groups_split")),
        "steps_to_threshold": math.nan if reached is None else float(reached),
        "approx_kl": _mean(_values(record, "objective/approx_kl")),
        "clipped": _mean(_values(record, "objective/clip_frac_low")) + _mean(_values(record, "objective/clip_frac_high")),
        "masked": _mean(_values(record, "objective/trust_region_zero_frac")),
        "scaffold_exact_start": statistics.fmean(_values(record, "rollout/scaffold_exact")[:5] or [math.nan]),
        "scaffold_exact_end": _last(record, "rollout/scaffold_exact", 5),
        "scaffold_p_start": (_values(record, "probe/scaffold_p") or [math.nan])[0],
        "scaffold_p_end": _last(record, "probe/scaffold_p"),
        "group_shared_tokens": _mean(_values(record, "rollout/group_shared_tokens")),
        "preference_entropy_start": (_values(record, "health/drift_preference_entropy") or [math.nan])[0],
        "movement": cumulative(record["scalars"].get("objective/approx_kl", [])),
        "preference_series": record["scalars"].get("health/drift_preference_entropy", []),
    }
    for tag in FLIP_TAGS:
        numbers[tag.removeprefix("health/flip_")] = _mean(_values(record, tag))
    for split in BINNED_SPLITS:
        for confidence in CONFIDENCE_BINS:
            for kind in ("mean_abs_change", "boosted", "suppressed", "tokens"):
                key = f"{kind}_{split}_{confidence}"
                numbers[key] = _mean(_values(record, f"health/flip_{key}"))
    return numbers


def cumulative(points: list[list[float]]) -> list[tuple[float, float]]:
    """``(step, sum of the values up to that step)``."""
    total, out = 0.0, []
    for step, value in points:
        total += value
        out.append((step, total))
    return out


def at_matched_movement(run: dict, movement: float) -> float:
    """The preference entropy, interpolated in steps, at the first step where the summed ``objective/approx_kl`` reaches ``movement``."""
    step = next((s for s, total in run["movement"] if total >= movement), None)
    series = run["preference_series"]
    if step is None or not series:
        return math.nan
    for (s0, v0), (s1, v1) in zip(series, series[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return math.nan


def matched_movement(runs: dict) -> float:
    """The largest summed approx-KL that every run reaches by its last preference-entropy measurement."""
    reached = []
    for seeds in runs.values():
        for run in seeds.values():
            if run["preference_series"] and run["movement"]:
                last = run["preference_series"][-1][0]
                reached.append(max((total for s, total in run["movement"] if s <= last), default=0.0))
    return min(reached) if reached else math.nan


def e10_summary(record: dict) -> dict:
    """:func:`summary` plus E10's own numbers (pre-registered in docs/experiments.md) and the run's scalars, which the
    identity check of ``DFPOMinTR`` compares point for point."""
    kl = record["scalars"].get("probe/preamble_kl", [])
    preference = record["scalars"].get("health/drift_preference_entropy", [])
    provenance = record.get("provenance", {})
    return {
        **summary(record),
        "preamble_kl": _mean([value for _, value in kl]),  # P1: mean of probe/preamble_kl over its measurements
        "preamble_kl_steps": tuple(int(step) for step, _ in kl),
        "preference_step_end": preference[-1][0] if preference else math.nan,  # P2 is the value at this step
        "preamble_p": _mean(_values(record, "rollout/preamble_p")),
        "preamble_stopped": _mean(_values(record, "rollout/preamble_stopped")),
        "probe_entropy_end": _last(record, "probe/preamble_entropy"),
        "probe_p_end": _last(record, "probe/preamble_p"),
        "zero_std_groups": _mean(_values(record, "rollout/frac_zero_std_groups")),
        "wall_s": float(record.get("wall_s", math.nan)),
        "commit": provenance.get("commit", "?"),
        "cpu": provenance.get("cpu", "?"),
        "scalars": record["scalars"],
    }


def load_e10(folder: Path | None = None) -> dict[tuple[str, str], dict[int, dict]]:
    """``(arm, setting) -> seed -> summary`` (:func:`e10_summary`) of E10's main runs, the files
    ``<arm>-<E10_SETTING>-seed<N>.json`` directly in ``folder`` (default ``benchmarks/study/results/E10``; the pilot's
    subfolder is not read)."""
    runs: dict = defaultdict(dict)
    for path in sorted((folder or RESULTS / "E10").glob(f"*-{E10_SETTING}-seed*.json")):
        record = json.loads(path.read_text())
        if record.get("setting") == E10_SETTING:
            runs[(record["arm"], record["setting"])][record["seed"]] = e10_summary(record)
    return dict(runs)


E11_EARLY_STEPS = 10  # S5, added after the pilot: the tax over steps 0-9, where the warm starts' contrast holds
E11_LAST_STEPS = 5  # S1: entropy over the last 5 steps (35-39)


def _at_step(record: dict, tag: str, step: int) -> float:
    return next((value for at, value in record["scalars"].get(tag, []) if at == step), math.nan)


def e11_summary(record: dict) -> dict:
    """:func:`summary` plus E11's own numbers (pre-registered in docs/experiments.md): the tax over steps 0-9 (S5), the
    entropy over the last 5 steps (S1), the manipulation check at step 0 and over the run, the episodes' shape."""
    provenance = record.get("provenance", {})
    tax = record["scalars"].get("health/learning_tax", [])
    return {
        **summary(record),
        "tax_early": _mean([value for step, value in tax if step < E11_EARLY_STEPS]),
        "entropy_end": _last(record, "health/entropy_mean", E11_LAST_STEPS),
        "entropy_start": _at_step(record, "health/entropy_mean", 0),
        "agreement_start": _at_step(record, "rollout/first_turn_agreement", 0),
        "agreement": _mean(_values(record, "rollout/first_turn_agreement")),
        "shared_policy_start": _at_step(record, "rollout/shared_policy_tokens", 0),
        "shared_policy": _mean(_values(record, "rollout/shared_policy_tokens")),
        "tool_calls": _mean(_values(record, "rollout/tool_calls")),
        "turns": _mean(_values(record, "rollout/turns")),
        "zero_std_groups": _mean(_values(record, "rollout/frac_zero_std_groups")),
        "steps": len(tax),
        "wall_s": float(record.get("wall_s", math.nan)),
        "commit": provenance.get("commit", "?"),
        "cpu": provenance.get("cpu", "?"),
    }


def load_e11(folder: Path | None = None) -> dict[tuple[str, str], dict[int, dict]]:
    """``(arm, setting) -> seed -> summary`` (:func:`e11_summary`) of E11's runs, the files ``<arm>-<setting>-seed<N>.json``
    directly in ``folder`` (default ``benchmarks/study/results/E11``; the pilot's subfolder and the warm starts' JSON
    are not read)."""
    runs: dict = defaultdict(dict)
    for path in sorted((folder or RESULTS / "E11").glob("*-seed*.json")):
        record = json.loads(path.read_text())
        runs[(record["arm"], record["setting"])][record["seed"]] = e11_summary(record)
    return dict(runs)


def e12_summary(record: dict) -> dict:
    """:func:`e11_summary` plus E12's own numbers (pre-registered in docs/experiments.md): the entropy over the run
    (S2) and over steps 0-9 (as the tax's, ``tax_early``), the largest absolute tax at any step (the identity check),
    the steps whose first-turn agreement is not 1 (the manipulation check: a forced run agrees at every step), the
    share of groups that end at their shared first turn (the forced arms only) and the SHA-256 of the warm start's
    weights it started from (``lab.runs.model_sha256``; None in a record stored without it)."""
    tax = _values(record, "health/learning_tax")
    entropy = record["scalars"].get("health/entropy_mean", [])
    agreement = record["scalars"].get("rollout/first_turn_agreement", [])
    return {
        **e11_summary(record),
        "entropy": _mean([value for _, value in entropy]),
        "entropy_early": _mean([value for step, value in entropy if step < E11_EARLY_STEPS]),
        "tax_abs_max": max(map(abs, tax), default=math.nan),
        "agreement_points": len(agreement),
        "disagreeing_steps": tuple(int(step) for step, value in agreement if value != 1),
        "forced_final": _mean(_values(record, "rollout/forced_final_first_turn")),
        "model_sha256": record.get("model_sha256"),
    }


def load_e12(folder: Path | None = None) -> dict[tuple[str, str], dict[int, dict]]:
    """``(arm, setting) -> seed -> summary`` (:func:`e12_summary`) of the runs ``<arm>-<setting>-seed<N>.json`` directly in
    ``folder`` (default ``benchmarks/study/results/E12``; ``…/E12P`` holds its check before the main runs, stored alike)."""
    runs: dict = defaultdict(dict)
    for path in sorted((folder or RESULTS / "E12").glob("*-seed*.json")):
        record = json.loads(path.read_text())
        runs[(record["arm"], record["setting"])][record["seed"]] = e12_summary(record)
    return dict(runs)


def load(folder: Path | None = None) -> dict[str, dict[tuple[str, str], dict[int, dict[str, float]]]]:
    """``experiment -> (arm, setting) -> seed -> summary`` of every stored run in ``folder`` (default
    ``benchmarks/study/results``); E10's main runs and E10-confirm's come from :func:`load_e10`, E11's and E12's from
    :func:`load_e11` and :func:`load_e12`."""
    folder = folder or RESULTS
    results: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(folder.glob("E[1-9]/*-seed*.json")):
        record = json.loads(path.read_text())
        if "scalars" not in record:  # E6's probes
            continue
        results[record["experiment"]][(record["arm"], record["setting"])][record["seed"]] = summary(record)
    for name in ("E10", "E10C"):  # E10 and its confirmation store their runs alike
        runs = load_e10(folder / name)
        if runs:
            results[name] = defaultdict(dict, runs)
    if e11 := load_e11(folder / "E11"):
        results["E11"] = defaultdict(dict, e11)
    for name in ("E12", "E12P"):  # E12's main runs and its check before them
        if e12 := load_e12(folder / name):
            results[name] = defaultdict(dict, e12)
    return results


def pooled(run: dict, split: str) -> float:
    """The mean ``|delta|`` of a binned split over all its bins (token-count weighted)."""
    counts = [run[f"tokens_{split}_{c}"] for c in CONFIDENCE_BINS]
    changes = [run[f"mean_abs_change_{split}_{c}"] for c in CONFIDENCE_BINS]
    pairs = [(n, d) for n, d in zip(counts, changes) if n > 0 and not math.isnan(d)]
    return sum(n * d for n, d in pairs) / sum(n for n, _ in pairs) if pairs else math.nan


def confidence_adjusted(run: dict, first: str, second: str) -> float:
    """``sum_b n_first,b (d_first,b - d_second,b) / sum_b n_first,b`` over the confidence bins both splits have tokens in."""
    total = weight = 0.0
    for confidence in CONFIDENCE_BINS:
        count = run[f"tokens_{first}_{confidence}"]
        a, b = run[f"mean_abs_change_{first}_{confidence}"], run[f"mean_abs_change_{second}_{confidence}"]
        if count > 0 and not math.isnan(a) and not math.isnan(b):
            total += count * (a - b)
            weight += count
    return total / weight if weight else math.nan

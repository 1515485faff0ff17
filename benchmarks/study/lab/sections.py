"""The sections of docs/experiments.md, one per experiment (E1-E12; E10's in ``lab.sections_e10``, E11's in
``lab.sections_e11``, E12's in ``lab.sections_e12``), each its tables and paired comparisons."""

import itertools
import math

from lab.cells import (
    EQUIVALENCE_MARGIN,
    accuracy_difference,
    cell,
    difference,
    equivalence,
    format_interval,
    pair,
    ratio,
    scientific_cell,
    trend,
)
from lab.runs import E2_SCAFFOLDS, E2_SPREADS, E7_TRUST_REGIONS, STUDY
from lab.sections_e10 import e10_confirm_section, e10_section
from lab.sections_e11 import e11_section
from lab.sections_e12 import e12_section
from lab.stats import mean_interval
from lab.summaries import (
    BINNED_SPLITS,
    CONFIDENCE_BINS,
    FLIP_SPLITS,
    at_matched_movement,
    confidence_adjusted,
    matched_movement,
    pooled,
)


def e1_section(runs: dict) -> list[str]:
    lines = ["#### E1 exchangeability (μ = 2)", "",
             "| objective | lr | seeds | final `val/accuracy` | − GRPO (paired) | learning tax | shared-context KL | entropy ratio (end) "
             "| preference entropy (end) | − GRPO (paired) | steps to +0.10 (reached) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (arm, setting), seeds in sorted(runs.items(), key=lambda item: (len(item[0][1]), item[0][1], item[0][0] != "GRPO", item[0][0])):
        reference = runs.get(("GRPO", setting), {})
        lr = setting.split("-lr")[1] if "-lr" in setting else "1e-4"
        reached = [r["steps_to_threshold"] for r in seeds.values() if not math.isnan(r["steps_to_threshold"])]
        paired, name = arm != "GRPO", (arm, setting)
        lines.append(
            f"| `{arm}` | {lr} | {len(seeds)} | {cell(seeds, 'val_end')} "
            f"| {accuracy_difference(seeds, reference, 'E1 accuracy', (arm, setting)) if paired else '–'} "
            f"| {scientific_cell(seeds, 'tax')} | {cell(seeds, 'shared_kl', 5)} | {cell(seeds, 'entropy_ratio')} "
            f"| {cell(seeds, 'preference_entropy')} "
            f"| {difference(seeds, reference, 'preference_entropy', family='E1 preference entropy', comparison=name) if paired else '–'} "
            f"| {format_interval(*mean_interval(reached), 0)} ({len(reached)}/{len(seeds)}) |"
        )
    return lines + [""] + matched_movement_lines(runs, "GRPO", "E1 drift at matched movement")


def matched_movement_lines(runs: dict, baseline: str, family: str) -> list[str]:
    """Preference entropy of each arm at the same summed approx-KL, paired with ``baseline`` at its own setting."""
    movement = matched_movement(runs)
    if math.isnan(movement):
        return []
    lines = [f"Preference entropy at matched movement: at the first step where the summed `objective/approx_kl` reaches "
             f"{movement:.3f} (the most that every run reaches by its last drift measurement), interpolated between "
             "measurements; paired with the same seed's " + f"`{baseline}`:", "",
             "| objective | setting | preference entropy at matched movement | − " + baseline + " (paired) |", "|---|---|---|---|"]
    for (arm, setting), seeds in sorted(runs.items()):
        name = (arm, setting)
        matched = {seed: {"matched": at_matched_movement(run, movement)} for seed, run in seeds.items()}
        reference = {seed: {"matched": at_matched_movement(run, movement)} for seed, run in runs.get((baseline, setting), {}).items()}
        lines.append(f"| `{arm}` | {setting} | {cell(matched, 'matched')} "
                     f"| {'–' if arm == baseline else difference(matched, reference, 'matched', family=family, comparison=name)} |")
    return lines


def e2_section(runs: dict) -> list[str]:
    lines = ["#### E2 dose-response (on-policy)", "",
             "| scaffold | spread | seeds | tax GRPO | tax DFPOMin | completion length GRPO / DFPOMin | `val/accuracy` start | GRPO end "
             "| DFPOMin end | DFPOMin − GRPO (paired) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gaps: dict[str, list[tuple[float, float]]] = {"scaffold": [], "spread": []}
    taxes: dict[str, list[tuple[float, float]]] = {"scaffold": [], "spread": []}
    for scaffold in E2_SCAFFOLDS:
        for spread in E2_SPREADS:
            setting = f"s{scaffold}v{spread}"
            grpo, dfpo = runs.get(("GRPO", setting), {}), runs.get(("DFPOMin", setting), {})
            if not grpo and not dfpo:
                continue
            lines.append(
                f"| {scaffold} | {spread} | {min(len(grpo), len(dfpo))} | {scientific_cell(grpo, 'tax')} | {scientific_cell(dfpo, 'tax')} "
                f"| {cell(grpo, 'completion_len', 1)} / {cell(dfpo, 'completion_len', 1)} "
                f"| {cell({**grpo, **dfpo}, 'val_start')} | {cell(grpo, 'val_end')} | {cell(dfpo, 'val_end')} "
                f"| {accuracy_difference(dfpo, grpo, 'E2 accuracy', (setting,))} |"
            )
            for run in grpo.values():
                taxes["scaffold"].append((scaffold, run["tax"]))
                taxes["spread"].append((spread, run["tax"]))
            for seed in set(grpo) & set(dfpo):
                gap = dfpo[seed]["val_end"] - grpo[seed]["val_end"]
                gaps["scaffold"].append((scaffold, gap))
                gaps["spread"].append((spread, gap))
    pooled = [gap for _, gap in gaps["scaffold"]]
    if pooled:
        as_pairs = {index: {"val_end": gap} for index, gap in enumerate(pooled)}
        zero = {index: {"val_end": 0.0} for index in range(len(pooled))}
        lines += ["", f"Pooled over the {len(pooled)} paired runs of all settings, DFPOMin − GRPO final accuracy: "
                  f"{accuracy_difference(as_pairs, zero, 'E2 accuracy', ('pooled',))} "
                  "(the runs of one seed share nothing across settings but the seed, so they are treated as independent pairs). "
                  f"Equivalence within ±{EQUIVALENCE_MARGIN:g}: {equivalence(as_pairs, zero)}."]
    trends = (("the paired gap (DFPOMin − GRPO final accuracy)", gaps, "paired runs", 3, "E2 accuracy"),
              ("GRPO's learning tax (mean over steps)", taxes, "GRPO runs", 4, "E2 learning tax slopes"))
    for title, points, unit_of_runs, digits, family in trends:
        if not points["scaffold"]:
            continue
        lines += ["", f"Trend of {title} over all settings and seeds, least-squares slope:", ""]
        for knob, unit in (("scaffold", "per 10 scaffold characters"), ("spread", "per 4 spread characters per step")):
            slope, call = trend(points[knob], 10 if knob == "scaffold" else 4, digits, family, ("slope", knob))
            lines.append(f"* {knob}: {slope} {unit} ({call}, {len(points[knob])} {unit_of_runs})")
    return lines


E3_COMPARISONS = (  # (label, key a, key b): a - b paired over seeds
    ("boosted share: positive − negative rollouts", "boosted_positive", "boosted_negative"),
    ("suppressed share: positive − negative rollouts", "suppressed_positive", "suppressed_negative"),
    ("mean abs change: shared − specific tokens", "mean_abs_change_shared", "mean_abs_change_specific"),
    ("positive-specific tokens: boosted − suppressed share", "boosted_positive_specific", "suppressed_positive_specific"),
    ("negative-specific tokens: suppressed − boosted share", "suppressed_negative_specific", "boosted_negative_specific"),
)


E3_MARGIN = 0.10  # "similar proportions": the margin stated in the choices table before E3 ran


def e3_section(runs: dict) -> list[str]:
    lines = ["#### E3 token flipping (GRPO, on-policy)", "",
             "Per run, the mean over the measured steps (every 10th); mean ± 95% t-interval over seeds.", "",
             "| tokens | boosted share | suppressed share | mean abs change of log-prob |", "|---|---|---|---|"]
    for seeds in runs.values():
        for part in FLIP_SPLITS:
            lines.append(f"| {part.replace('_', '-')} | {cell(seeds, f'boosted_{part}')} | {cell(seeds, f'suppressed_{part}')} "
                         f"| {cell(seeds, f'mean_abs_change_{part}', 4)} |")
        lines += ["", "| paired over seeds | difference |", "|---|---|"]
        lines += [f"| {label} | {difference(seeds, seeds, a, digits=4, b_key=b, family='E3 token flips', comparison=(a, b))} |"
                  for label, a, b in E3_COMPARISONS]
        similar = {seed: {"similar": run["boosted_positive"] - run["boosted_negative"]} for seed, run in seeds.items()}
        zero = {seed: {"similar": 0.0} for seed in seeds}
        lines += ["", f"\"Similar\" boosted shares, positive − negative rollouts, equivalence within the ±{E3_MARGIN:g} stated in "
                  f"advance: {equivalence(similar, zero, 'similar', E3_MARGIN)}."]
    return lines


def e4_section(runs: dict) -> list[str]:
    lines = ["#### E4 batching plans (GRPO)", "",
             "| μ | plan | seeds | final `val/accuracy` | − shuffled (paired) | `batch/groups_split` | boosted share, negative rollouts |",
             "|---|---|---|---|---|---|---|"]
    for (plan, setting), seeds in sorted(runs.items(), key=lambda item: item[0][1]):
        reference = runs.get(("shuffled", setting), {})
        lines.append(f"| {setting.rsplit('mu', 1)[1]} | `{plan}` | {len(seeds)} | {cell(seeds, 'val_end')} "
                     f"| {accuracy_difference(seeds, reference, 'E4 accuracy', (plan, setting)) if plan != 'shuffled' else '–'} "
                     f"| {cell(seeds, 'groups_split', 2)} "
                     f"| {cell(seeds, 'boosted_negative')} |")
    return lines


def e5_section(runs: dict) -> list[str]:
    lines = ["#### E5 group size (128 rollouts per round, μ = 2)", "",
             "| G | seeds | GRPO end | GSPO end | DFPOMin end | DFPOMin − GSPO (paired) | DFPOMin − GRPO (paired) |",
             "|---|---|---|---|---|---|---|"]
    gaps: dict[str, list[tuple[float, float]]] = {"GSPO": [], "GRPO": []}
    for group in (2, 4, 8, 16):
        setting = f"{STUDY}-G{group}"
        dfpo, gspo, grpo = (runs.get((arm, setting), {}) for arm in ("DFPOMin", "GSPO", "GRPO"))
        if not dfpo:
            continue
        lines.append(f"| {group} | {len(dfpo)} | {cell(grpo, 'val_end')} | {cell(gspo, 'val_end')} | {cell(dfpo, 'val_end')} "
                     f"| {accuracy_difference(dfpo, gspo, 'E5 accuracy', ('GSPO', group))} "
                     f"| {accuracy_difference(dfpo, grpo, 'E5 accuracy', ('GRPO', group))} |")
        for baseline, other in (("GSPO", gspo), ("GRPO", grpo)):
            gaps[baseline] += [(math.log2(group), dfpo[s]["val_end"] - other[s]["val_end"]) for s in set(dfpo) & set(other)]
    lines += ["", "Trend of the paired gap over G, least-squares slope per doubling of G:", ""]
    for baseline, points in gaps.items():
        slope, call = trend(points, family="E5 accuracy", comparison=("slope", baseline))
        lines.append(f"* DFPOMin − {baseline}: {slope} per doubling ({call}, {len(points)} paired runs)")
    return lines


E6_QUANTITIES = (("kernel", "first-order ⟨∇ log p_j, ∇ log p_k⟩", 2), ("cosine", "cosine of the two gradients", 3),
                 ("change", "Δ log p_j, one SGD step at lr 0.1", 3))


def e6_section(seeds: dict[int, dict]) -> list[str]:
    """Coupling probe: per pair class, the mean over pairs of each seed, then mean ± t-interval over seeds."""
    per_class = {name: {seed: record["classes"][name] for seed, record in seeds.items()}
                 for name in ("identical_low", "identical_high", "different_low")}
    lines = ["#### E6 coupling (masked-update probe)", "",
             f"Seeds: {len(seeds)}; {next(iter(seeds.values()))['classes']['identical_low']['pairs']} pairs per class and seed. "
             "Mean over pairs per seed, then mean ± 95% t-interval over seeds.", "",
             "| pair (k updated, j measured) | " + " | ".join(label for _, label, _ in E6_QUANTITIES) + " | abs first-order |",
             "|---|" + "---|" * (len(E6_QUANTITIES) + 1)]
    for name, runs in per_class.items():
        lines.append(f"| {name.replace('_', ', ')} | " + " | ".join(cell(runs, f"mean_{q}", d) for q, _, d in E6_QUANTITIES)
                     + f" | {cell(runs, 'mean_abs_kernel', 2)} |")
    lines += ["", "| paired over seeds | first-order coupling | cosine |", "|---|---|---|"]
    low, high, different = per_class["identical_low"], per_class["identical_high"], per_class["different_low"]
    for label, other in (("identical low − identical high confidence", high), ("identical − different tokens, low confidence", different)):
        lines.append(f"| {label} | {difference(low, other, 'mean_kernel', 2, family='E6 first-order coupling', comparison=(label,))} "
                     f"| {difference(low, other, 'mean_cosine', 3, family='E6 cosine', comparison=(label,))} |")
    return lines


def e7_section(runs: dict) -> list[str]:
    lines = ["#### E7 trust regions for DFPO (μ = 2, 2 mini-batches, lr 1e-4)", "",
             "| objective | seeds | final `val/accuracy` | − GRPO (paired) | − DFPOMin (paired) | approx-KL (mean) | masked or clipped "
             "share | learning tax (mean) | largest step's tax | shared-context KL | preference entropy (end) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = ["GRPO", "DrGRPO", "DFPOMin", "DFPOMin-TokenRatioMask", "DFPOMin-GroupRatioDrop", "DFPOMin-TokenRatioWeight"]
    for (arm, setting), seeds in sorted(runs.items(), key=lambda item: order.index(item[0][0]) if item[0][0] in order else 99):
        grpo, dfpo = runs.get(("GRPO", setting), {}), runs.get(("DFPOMin", setting), {})
        share = "masked" if arm.startswith("DFPOMin-") else "clipped"
        shares = {"DFPOMin": "none (clip-free)", "DFPOMin-TokenRatioWeight": "none (reweights)"}
        lines.append(
            f"| `{arm}` | {len(seeds)} | {cell(seeds, 'val_end')} "
            f"| {accuracy_difference(seeds, grpo, 'E7 accuracy', pair(arm, 'GRPO')) if arm != 'GRPO' else '–'} "
            f"| {accuracy_difference(seeds, dfpo, 'E7 accuracy', pair(arm, 'DFPOMin')) if arm != 'DFPOMin' else '–'} "
            f"| {cell(seeds, 'approx_kl', 4)} "
            f"| {shares.get(arm) or f'{cell(seeds, share)} ({share})'} | {scientific_cell(seeds, 'tax')} "
            f"| {scientific_cell(seeds, 'tax_max')} "
            f"| {cell(seeds, 'shared_kl', 5)} | {cell(seeds, 'preference_entropy')} |"
        )
    setting = f"{STUDY}-mu2"
    regions = [f"DFPOMin-{region}" for region in E7_TRUST_REGIONS]
    if all((arm, setting) in runs for arm in regions):
        lines += ["", "Between the trust regions, final `val/accuracy` (paired; in the same family as the table's columns):", "",
                  "| comparison | difference |", "|---|---|"]
        for first, second in itertools.combinations(regions, 2):
            lines.append(f"| `{first}` − `{second}` | "
                         f"{accuracy_difference(runs[(first, setting)], runs[(second, setting)], 'E7 accuracy', pair(first, second))} |")
    lines += ["", "Movement per step, each arm's mean `objective/approx_kl` over GRPO's (same seed), a ratio of paired means:", "",
              "| objective | approx-KL ÷ GRPO's |", "|---|---|"]
    for (arm, setting), seeds in sorted(runs.items()):
        if arm != "GRPO" and ("GRPO", setting) in runs:
            lines.append(f"| `{arm}` | {ratio(seeds, runs[('GRPO', setting)], 'approx_kl')} |")
    return lines + [""] + matched_movement_lines(runs, "GRPO", "E7 drift at matched movement")




def e8_section(runs: dict) -> list[str]:
    lines = ["#### E8 a causal test of the learning tax (on-policy DFPOMin from the short warm start)", "",
             "| arm | seeds | learning tax | shared-context KL | scaffold p (start → end) | exact scaffold (first 5 → last 5 steps) "
             "| shared prefix (tokens) | preference entropy (end) | final `val/accuracy` |", "|---|---|---|---|---|---|---|---|---|"]
    for (arm, _), seeds in sorted(runs.items(), key=lambda item: (item[0][0] != "DFPOMin", item[0][0])):
        lines.append(
            f"| `{arm}` | {len(seeds)} | {scientific_cell(seeds, 'tax')} | {cell(seeds, 'shared_kl', 5)} "
            f"| {cell(seeds, 'scaffold_p_start')} → {cell(seeds, 'scaffold_p_end')} "
            f"| {cell(seeds, 'scaffold_exact_start')} → {cell(seeds, 'scaffold_exact_end')} | {cell(seeds, 'group_shared_tokens', 2)} "
            f"| {cell(seeds, 'preference_entropy')} | {cell(seeds, 'val_end')} |"
        )
    lines += ["", "| paired with the untouched arm (same seed) | learning tax | shared-context KL | exact scaffold (last 5 steps) "
              "| preference entropy (end) | final `val/accuracy` |", "|---|---|---|---|---|---|"]
    for (arm, setting), seeds in sorted(runs.items()):
        if arm == "DFPOMin":
            continue
        base = runs.get(("DFPOMin", setting), {})
        name = (arm,)
        lines.append(f"| `{arm}` − `DFPOMin` | {difference(seeds, base, 'tax', 4, family='E8 learning tax', comparison=name)} "
                     f"| {difference(seeds, base, 'shared_kl', 5, family='E8 shared-context KL', comparison=name)} "
                     f"| {difference(seeds, base, 'scaffold_exact_end', family='E8 exact scaffold', comparison=name)} "
                     f"| {difference(seeds, base, 'preference_entropy', family='E8 preference entropy', comparison=name)} "
                     f"| {accuracy_difference(seeds, base, 'E8 accuracy', name)} |")
    return lines


SHARED, SIGNS = "E9 shared − specific, mean abs Δ log p", "E9 both − one sign, mean abs Δ log p"
BOOSTED = "E9 boosted share, positive − negative"


def e9_section(runs: dict) -> list[str]:
    plans = {key: seeds for key, seeds in runs.items() if key[1].endswith("-mb8")}
    flips = {key: seeds for key, seeds in runs.items() if key[1].endswith("-flips")}
    lines = ["#### E9 batching plans at μ = 4, 8 mini-batches (GRPO, lr 5e-5, 128 steps)", "",
             "| plan | seeds | final `val/accuracy` | − shuffled (paired) | − reward-balanced (paired) | `batch/groups_split` "
             "| learning tax |", "|---|---|---|---|---|---|---|"]
    for (plan, setting), seeds in sorted(plans.items()):
        shuffled, balanced = plans.get(("shuffled", setting), {}), plans.get(("reward_balanced", setting), {})
        name = pair(plan, "reward_balanced")
        lines.append(f"| `{plan}` | {len(seeds)} | {cell(seeds, 'val_end')} "
                     f"| {accuracy_difference(seeds, shuffled, 'E9 accuracy', pair(plan, 'shuffled')) if plan != 'shuffled' else '–'} "
                     f"| {'–' if plan == 'reward_balanced' else accuracy_difference(seeds, balanced, 'E9 accuracy', name)} "
                     f"| {cell(seeds, 'groups_split', 2)} | {scientific_cell(seeds, 'tax')} |")
    setting = f"{STUDY}-mu4-mb8"
    named = {plan: plans.get((plan, setting), {}) for plan in ("query_preserved", "shuffled", "reward_balanced", "sign_sorted")}
    if all(named.values()):
        lines += ["", f"Equivalence of final `val/accuracy` within ±{EQUIVALENCE_MARGIN:g} (TOST, the margin stated in advance), where a "
                  "verdict says a plan costs nothing:", "",
                  f"* shuffled − query-preserved (splitting groups): {equivalence(named['shuffled'], named['query_preserved'])}",
                  f"* sign-sorted − reward-balanced: {equivalence(named['sign_sorted'], named['reward_balanced'])}",
                  "", "Learning tax, as a ratio of paired means (shuffled splits every group, query-preserved none):", "",
                  f"* shuffled ÷ query-preserved: {ratio(named['shuffled'], named['query_preserved'], 'tax')}",
                  f"* reward-balanced ÷ query-preserved: {ratio(named['reward_balanced'], named['query_preserved'], 'tax')}",
                  f"* sign-sorted ÷ query-preserved: {ratio(named['sign_sorted'], named['query_preserved'], 'tax')}"]
    if not flips:
        return lines
    lines += ["", "#### E9 token flips by confidence (on-policy, lr 2e-4, every 10th step)", "",
              "Mean `|Δ log p|` of one optimizer step, per bin of the token's probability before the step; per run the mean over "
              "measured steps, then mean ± 95% t-interval over seeds; token counts are per measured step.", "",
              "| arm | p before the step | tokens shared / specific | shared | specific | shared − specific (paired) "
              "| tokens in both signs / one | both signs | one sign | both − one (paired) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (arm, _), seeds in sorted(flips.items(), key=lambda item: (item[0][0] != "GRPO", item[0][0])):
        for confidence in CONFIDENCE_BINS:
            key = {split: f"mean_abs_change_{split}_{confidence}" for split in BINNED_SPLITS}.get
            lines.append(
                f"| `{arm}` | {confidence[1:]} | {cell(seeds, f'tokens_shared_{confidence}', 0)} / "
                f"{cell(seeds, f'tokens_specific_{confidence}', 0)} | {cell(seeds, key('shared'), 4)} "
                f"| {cell(seeds, key('specific'), 4)} "
                f"| {difference(seeds, seeds, key('shared'), 4, key('specific'), family=SHARED, comparison=(arm, confidence))} "
                f"| {cell(seeds, f'tokens_both_signs_{confidence}', 0)} / {cell(seeds, f'tokens_one_sign_{confidence}', 0)} "
                f"| {cell(seeds, key('both_signs'), 4)} | {cell(seeds, key('one_sign'), 4)} "
                f"| {difference(seeds, seeds, key('both_signs'), 4, key('one_sign'), family=SIGNS, comparison=(arm, confidence))} |"
            )
    lines += ["", "The same comparison with confidence held fixed: per run, the bins' differences (shared − specific, and both "
              "signs − one sign) averaged with the first split's token counts as weights, i.e. the specific tokens reweighted "
              "to the shared tokens' confidence; beside it the raw difference over all tokens (E3's comparison):", "",
              "| arm | shared − specific, raw | at the shared tokens' confidence | both − one sign, raw | at equal confidence |",
              "|---|---|---|---|---|"]
    adjusted_runs = {}
    for (arm, _), seeds in sorted(flips.items(), key=lambda item: (item[0][0] != "GRPO", item[0][0])):
        adjusted = {seed: {"shared": confidence_adjusted(run, "shared", "specific"),
                           "signs_raw": pooled(run, "both_signs") - pooled(run, "one_sign"),
                           "signs": confidence_adjusted(run, "both_signs", "one_sign")} for seed, run in seeds.items()}
        zero = {seed: {"shared": 0.0, "signs": 0.0, "signs_raw": 0.0} for seed in seeds}
        adjusted_runs[arm] = adjusted
        raw = difference(seeds, seeds, "mean_abs_change_shared", 4, "mean_abs_change_specific", family=SHARED, comparison=(arm, "raw"))
        lines.append(f"| `{arm}` | {raw} "
                     f"| {difference(adjusted, zero, 'shared', 4, family=SHARED, comparison=(arm, 'equal confidence'))} "
                     f"| {difference(adjusted, zero, 'signs_raw', 4, family=SIGNS, comparison=(arm, 'raw'))} "
                     f"| {difference(adjusted, zero, 'signs', 4, family=SIGNS, comparison=(arm, 'equal confidence'))} |")
    lines += ["", "How much smaller the shared − specific gap gets at equal confidence: raw ÷ at the shared tokens' confidence, "
              "a ratio of paired means:", "", "| arm | raw ÷ at equal confidence |", "|---|---|"]
    for (arm, _), seeds in sorted(flips.items(), key=lambda item: (item[0][0] != "GRPO", item[0][0])):
        raw = {seed: {"gap": run["mean_abs_change_shared"] - run["mean_abs_change_specific"]} for seed, run in seeds.items()}
        lines.append(f"| `{arm}` | {ratio(raw, adjusted_runs[arm], 'gap', 'shared')} |")
    lines += ["", "| arm | seeds | boosted share, positive rollouts | negative rollouts | positive − negative (paired) "
              "| suppressed share, positive rollouts | negative rollouts | final `val/accuracy` |", "|---|---|---|---|---|---|---|---|"]
    for (arm, _), seeds in sorted(flips.items(), key=lambda item: (item[0][0] != "GRPO", item[0][0])):
        lines.append(f"| `{arm}` | {len(seeds)} | {cell(seeds, 'boosted_positive')} | {cell(seeds, 'boosted_negative')} "
                     f"| {difference(seeds, seeds, 'boosted_positive', b_key='boosted_negative', family=BOOSTED, comparison=(arm,))} "
                     f"| {cell(seeds, 'suppressed_positive')} "
                     f"| {cell(seeds, 'suppressed_negative')} | {cell(seeds, 'val_end')} |")
    return lines


TITLES = {"E1": "E1 exchangeability", "E2": "E2 dose-response", "E3": "E3 token flipping", "E4": "E4 batching plans", "E5": "E5 group size",
          "E7": "E7 trust regions", "E8": "E8 causal learning tax", "E9": "E9 batching and flips at full dose",
          "E10": "E10 forced branching"}
SECTIONS = {"E1": e1_section, "E2": e2_section, "E3": e3_section, "E4": e4_section, "E5": e5_section}
LATER_SECTIONS = {"E7": e7_section, "E8": e8_section, "E9": e9_section, "E10": e10_section}  # after E6, in the order they ran


def experiment_sections(results: dict, probes: dict[int, dict]) -> list[str]:
    """The experiments' sections, in the order they ran."""
    lines = []
    for name, section in SECTIONS.items():
        if name not in results:
            lines += [f"#### {TITLES[name]}", "", "Not run yet.", ""]
            continue
        lines += section(dict(results[name])) + [""]
        if name == "E2":
            figure = "../benchmarks/study/results/E2.png"
            lines += [f"![E2: learning tax and accuracy gap against scaffold length, one line per spread]({figure})", ""]
    lines += (e6_section(probes) if probes else ["#### E6 coupling", "", "Not run yet."]) + [""]
    for name, section in LATER_SECTIONS.items():
        lines += (section(dict(results[name])) if name in results else [f"#### {TITLES[name]}", "", "Not run yet."]) + [""]
    if "E10C" in results:
        lines += e10_confirm_section(dict(results["E10C"]), dict(results.get("E10", {}))) + [""]
    lines += e11_section(dict(results.get("E11", {}))) + [""]
    if "E12" in results or "E12P" in results:  # nothing until its check before the main runs is stored
        lines += e12_section(dict(results.get("E12", {})), dict(results.get("E12P", {}))) + [""]
    return lines

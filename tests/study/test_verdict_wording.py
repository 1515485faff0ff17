"""Every verdict docs/experiments.md's generated part and README.md's experiment bullets print follows, by the rule stated
at the top of docs/experiments.md, from the numbers printed beside it, and every comparison prints its MDE.

The rule, re-implemented here from the docs rather than imported: "effect" where the test (Holm-adjusted where a
family applies) rejects at 0.05; "no difference larger than m" only where a margin m was stated for the outcome and
TOST rejects at 0.05 (the 90% interval inside ±m); otherwise "inconclusive" (and so below 5 pairs). The checks read the
text only, so they hold whatever code wrote it, and they fail on the labels the rule replaced (E9's old "null").

The hand-written prose that quotes these numbers (the claims in docs/experiments.md, the E11 paragraph of
docs/agents.md, README.md's bullets) is checked sentence by sentence against three lists: a phrasing that names one
cause for a contrast its pre-registration calls confounded (``CONFOUNDED``, anchored to the pre-registration's own
sentence); a ratio (``43×``, "an order of magnitude") in a sentence that names two settings (``SETTINGS``: an
experiment's number or the words for its task); an E11 success claim that does not name the warm start it was shown
from (``ONE_WARM_START``). The claims table's E11 rows must carry the generated table's verdict words. What these
checks cannot catch: a cause named in other words than the listed ones ("thanks to agreement"), a confounded contrast
not in ``CONFOUNDED``, a ratio whose two sides sit in different sentences or whose other side is named by neither an
experiment's number nor a listed setting word, a ratio written out in words ("ten times"), and a comparison that is
wrong for a reason other than these (two objectives that differ in more than the named part): those need a reader.
"""

import math
import re
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]
DOC, README = ROOT / "docs" / "experiments.md", ROOT / "README.md"
ALPHA, MIN_SEEDS = 0.05, 5
P = r"<?[\d.]+"  # a printed p: 0.0093, 0.22, <0.001
INTERVAL = r"(?P<interval>–|-?\d+\.\d+(?: ± \d+\.\d+)?)"
CELL = re.compile(INTERVAL + r" \((?P<verdict>[^;()]+)(?P<fields>(?:; [^;()]+)*); n=(?P<n>\d+)\)")
TREND = re.compile(INTERVAL + r" per [^()]+\((?P<verdict>[^;()]+)(?P<fields>(?:; [^;()]+?)*), \d+ (?:paired|GRPO) runs\)")
WELCH = re.compile(INTERVAL + r" \((?P<verdict>[^;()]+)(?P<fields>(?:; [^;()]+)*); Welch df (?P<df>[\d.]+); "
                   r"n=(?P<a>\d+)\+(?P<b>\d+)\)")
TOST_LINE = re.compile(rf"TOST p (?P<p>{P})(?:, Holm (?P<holm>{P}))? \(p of > −(?P<margin>[\d.]+): {P}, of < \+[\d.]+: {P}\): "
                       r"\*\*(?P<verdict>[^*]+)\*\* \(n=(?P<n>\d+)\)")
FRAGMENT = re.compile(rf"(?:Holm )?p (?P<p>{P})(?:, TOST ±(?P<margin>[\d.]+) (?:Holm )?p (?P<tost>{P}))?: (?P<verdict>[a-z][^;),]*)")
CELL_VERDICT = re.compile(r"\((?:effect|inconclusive|n/a|nulls?|no effect|no difference larger than [\d.]+)[;,]")
BOLD_VERDICT = re.compile(r"\*\*(?:effect[^*]*|inconclusive|n/a|nulls?|no effect|no difference larger than [\d.]+)\*\*")
README_WORDS = re.compile(r"\beffects?\b|\bnulls?\b|\bequivalent\b(?! solutions)|no difference larger than")
PREDICTED = {"P1": 1, "P2": -1}  # E10-confirm's pre-registration: noise − untouched > 0 on P1, < 0 on P2
E11_PREDICTED = {"E11 P1": 1, "E11 P2": 1, "E11 P3": 0}  # E11's: GRPO's tax above DFPOMin's, larger where groups agree


def printed_p(text: str) -> float:
    """A printed p as a number; one that prints as 0.05 cannot say on which side of 0.05 it lies."""
    if text == "0.05":
        raise ValueError("a p printed as 0.05 is ambiguous at two significant digits")
    return 0.0 if text.startswith("<") else float(text)


def rule(p: float, n: int, margin: float | None = None, p_tost: float = math.nan) -> str:
    """The verdict the docs' rule gives a comparison of ``n`` pairs with test p ``p`` and, where a margin was stated,
    equivalence p ``p_tost``."""
    if n < MIN_SEEDS:
        return "inconclusive"
    if p < ALPHA:
        return "effect"
    if margin is not None and p_tost < ALPHA:
        return f"no difference larger than {margin:.2f}"
    return "inconclusive"


def interval(text: str) -> tuple[float, float, int]:
    """``(mean, half, decimals)`` of a printed ``mean ± half``."""
    mean, half = text.split(" ± ")
    return float(mean), float(half), len(mean.split(".")[1])


def equivalence_problem(text: str, n: int, margin: float, p_tost: float) -> str | None:
    """Where the printed interval decides it beyond rounding: the raw TOST rejects exactly when the 90% interval lies
    inside ±margin."""
    mean, half, decimals = interval(text)
    reach = abs(mean) + half * stats.t.ppf(0.95, n - 1) / stats.t.ppf(0.975, n - 1)
    if abs(reach - margin) > 10.0**-decimals and (reach < margin) != (p_tost < ALPHA):
        return f"{text}: the 90% interval reaches {reach:.4f} against ±{margin}, but TOST p is {p_tost}"
    return None


def mde_problem(text: str, n: int, mde: float, df: float | None = None) -> str | None:
    """The printed MDE is the 80%-power one of the printed interval, up to rounding (``n - 1`` degrees of freedom, or
    Welch's ``df``)."""
    mean, half, decimals = interval(text)
    df = n - 1 if df is None else df
    expected = half * (stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) / stats.t.ppf(0.975, df)
    if abs(mde - expected) > 1.5 * 10.0**-decimals:
        return f"{text}: MDE {mde}, but the interval gives {expected:.4f}"
    return None


def fields(text: str) -> dict[str, str]:
    """A cell's ``; p X, Holm Y; TOST ±m p Z, Holm W; MDE M`` fields by name."""
    found = {}
    for part in filter(None, text.split("; ")):
        if part.startswith("p "):
            raw, _, holm = part[2:].partition(", Holm ")
            found |= {"p": raw} | ({"holm": holm} if holm else {})
        elif part.startswith("TOST ±"):
            margin, _, rest = part[6:].partition(" p ")
            raw, _, holm = rest.partition(", Holm ")
            found |= {"margin": margin, "tost": raw} | ({"tost_holm": holm} if holm else {})
        elif part.startswith("MDE "):
            found["mde"] = part[4:]
    return found


def cell_problems(match: re.Match, trend: bool = False) -> list[str]:
    """What is wrong with one comparison cell (or trend line): its verdict against the rule, its TOST against its
    interval, and its MDE (present, and the one of its interval; for a trend, present)."""
    text, found = match.group(0), fields(match.group("fields"))
    n = 10**6 if trend else int(match.group("n"))  # a trend's seeds are not printed; every trend has 5 or more
    has_interval = "±" in match.group("interval")
    problems = []
    if not has_interval:
        return [] if match.group("verdict") in ("inconclusive", "n/a") and "p" not in found else [f"{text}: a verdict without an interval"]
    try:
        p = printed_p(found.get("holm", found.get("p", "nan")))
        margin = float(found["margin"]) if "margin" in found else None
        p_tost = printed_p(found.get("tost_holm", found.get("tost", "nan")))
    except ValueError as error:
        return [f"{text}: {error}"]
    expected = rule(p, n, margin, p_tost)
    if match.group("verdict") != expected:
        problems.append(f"{text}: says {match.group('verdict')!r}, the rule gives {expected!r}")
    if margin is not None and not trend:
        problems.append(equivalence_problem(match.group("interval"), n, margin, printed_p(found["tost"])))
    if "mde" not in found:
        problems.append(f"{text}: no MDE")
    elif not trend:
        problems.append(mde_problem(match.group("interval"), n, float(found["mde"])))
    return [problem for problem in problems if problem]


def welch_problems(match: re.Match) -> list[str]:
    """A Welch cell (two unpaired samples, no margin): its verdict by the rule at the smaller sample's size, its MDE
    with the printed Welch degrees of freedom."""
    text, found = match.group(0), fields(match.group("fields"))
    if "±" not in match.group("interval"):
        return [] if match.group("verdict") in ("inconclusive", "n/a") and "p" not in found else [f"{text}: a verdict without an interval"]
    expected = rule(printed_p(found.get("holm", found.get("p", "nan"))), min(int(match.group("a")), int(match.group("b"))))
    problems = [] if match.group("verdict") == expected else [f"{text}: says {match.group('verdict')!r}, the rule gives {expected!r}"]
    if "mde" not in found:
        return problems + [f"{text}: no MDE"]
    problem = mde_problem(match.group("interval"), 0, float(found["mde"]), float(match.group("df")))
    return problems + ([problem] if problem else [])


def e11_row_problems(line: str) -> list[str]:
    """A row of E11's primary table: its verdict by the rule on the Holm p (and, for P3, the raw TOST p against ±0.04),
    an effect naming whether it goes the predicted way; the MDE (α 0.05) the one of its interval (Welch's degrees of
    freedom where printed); the raw TOST against the interval."""
    label, _, size, difference, _, mde, _, holm, tost, verdict = columns(line)
    if difference == "–":
        return [] if verdict == "**n/a**" else [f"{line}: a verdict without seeds"]
    welch = re.fullmatch(r"(\d+) \+ (\d+) \(Welch df ([\d.]+)\)", size)
    n = min(int(welch.group(1)), int(welch.group(2))) if welch else int(size)
    margin = float(re.search(r"\(±([\d.]+)\)", tost).group(1)) if tost != "–" else None
    raw_tost = printed_p(tost.split(" ")[0]) if margin is not None else math.nan
    expected = rule(printed_p(holm), n, margin, raw_tost)
    predicted = E11_PREDICTED[label.split(":")[0]]
    if expected == "effect" and predicted:
        goes = float(difference.split(" ± ")[0]) * predicted > 0
        expected += ", the predicted direction" if goes else ", against the predicted direction"
    problems = [] if verdict == f"**{expected}**" else [f"{line}: the rule gives {expected!r}"]
    first_mde = mde.split(" / ")[0]
    if not re.fullmatch(r"\d+\.\d+", first_mde):
        return problems + [f"{line}: no MDE"]
    problems.append(mde_problem(difference, n, float(first_mde), float(welch.group(3)) if welch else None))
    if margin is not None:
        problems.append(equivalence_problem(difference, n, margin, raw_tost))
    return [p for p in problems if p]


def e12_row_problems(line: str) -> list[str]:
    """A row of E12's tables: its verdict by the rule on the Holm p and the Holm-adjusted TOST p, the margin as the
    pre-registration writes it (0.002), an effect on P1 or P2 naming whether it goes the predicted way (> 0); the MDE
    (α 0.05) the one of its interval; the raw TOST against the interval."""
    label, _, n, difference, _, mde, _, holm, tost, holm_tost, verdict = columns(line)
    if difference == "–":
        return [] if verdict == "**inconclusive**" else [f"{line}: a verdict without pairs"]
    margin = re.search(r"\(±([\d.]+)\)", tost).group(1)
    try:
        raw_tost = printed_p(tost.split(" ")[0])
        expected = rule(printed_p(holm), int(n), float(margin), printed_p(holm_tost))
    except ValueError as error:
        return [f"{line}: {error}"]
    if expected.startswith("no difference larger than"):
        expected = f"no difference larger than {margin}"
    if expected == "effect" and label.startswith("E12 P"):
        goes = float(difference.split(" ± ")[0]) > 0
        expected += ", the predicted direction" if goes else ", against the predicted direction"
    problems = [] if verdict == f"**{expected}**" else [f"{line}: the rule gives {expected!r}"]
    first_mde = mde.split(" / ")[0]
    if not re.fullmatch(r"\d+\.\d+", first_mde):
        return problems + [f"{line}: no MDE"]
    return [p for p in problems + [mde_problem(difference, int(n), float(first_mde)),
                                   equivalence_problem(difference, int(n), float(margin), raw_tost)] if p]


def tost_line_problems(match: re.Match) -> list[str]:
    """A TOST sentence: "no difference larger than m" exactly where its (Holm-adjusted, if given) TOST p is below 0.05."""
    p = printed_p(match.group("holm") or match.group("p"))
    expected = rule(1.0, int(match.group("n")), float(match.group("margin")), p)
    return [] if match.group("verdict") == expected else [f"{match.group(0)}: the rule gives {expected!r}"]


def columns(line: str) -> list[str]:
    """A Markdown table row's cells (an escaped ``\\|`` stays inside its cell)."""
    return [column.strip() for column in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def e10_row_problems(line: str) -> list[str]:
    """A row of E10's primary table: verdict from the Holm p and the Holm-adjusted TOST p, the equivalence column from
    the latter, the raw TOST against the interval, the MDE (α 0.05) present and the one of the interval."""
    label, _, _, n, difference, _, holm, tost, equivalent, mde, verdict = columns(line)
    if difference == "–":
        return [] if verdict == "**n/a**" else [f"{line}: a verdict without pairs"]
    margin = float(re.search(r"\(±([\d.]+)\)", label).group(1))
    raw_tost, holm_tost = (printed_p(p) for p in tost.split(", Holm "))
    expected = rule(printed_p(holm), int(n), margin, holm_tost)
    problems = [] if verdict == f"**{expected}**" else [f"{line}: the rule gives {expected!r}"]
    if equivalent != (f"within ±{margin:.2f}" if holm_tost < ALPHA else "not shown"):
        problems.append(f"{line}: the equivalence column does not follow the Holm-adjusted TOST p")
    first_mde = mde.split(" / ")[0]
    if not re.fullmatch(r"\d+\.\d+", first_mde):
        return problems + [f"{line}: no MDE"]
    return [p for p in problems + [equivalence_problem(difference, int(n), margin, raw_tost),
                                   mde_problem(difference, int(n), float(first_mde))] if p]


def e10_confirm_row_problems(line: str) -> list[str]:
    """A row of E10-confirm's table: its pre-registered verdict (the rule on one test, the effect's direction named)."""
    label, _, n, difference, _, mde, p, tost, _, verdict = columns(line)
    margin = float(re.search(r"\(±([\d.]+)\)", tost).group(1))
    raw_tost = printed_p(tost.split(" ")[0])
    expected = rule(printed_p(p), int(n), margin, raw_tost)
    if expected == "effect":
        predicted = float(difference.split(" ± ")[0]) * PREDICTED[label[:2]] > 0
        expected += ", the predicted direction" if predicted else ", against the predicted direction"
    problems = [] if verdict == f"**{expected}**" else [f"{line}: the rule gives {expected!r}"]
    return [p for p in problems + [equivalence_problem(difference, int(n), margin, raw_tost),
                                   mde_problem(difference, int(n), float(mde))] if p]


def replication_problems(text: str, confirm_rows: list[str]) -> list[str]:
    """E10-confirm's replication line follows its P2 verdict (the pre-registered rule: replicated only as an effect in
    the predicted direction)."""
    p2 = [columns(line)[-1] for line in confirm_rows if line.startswith("| P2: ")]
    replicated = p2 == ["**effect, the predicted direction**"]
    return [f"{line}: does not follow E10-confirm's P2 verdict" for line in text.splitlines()
            if line.startswith("**Replication of E10's P2 effect")
            and not line.endswith(f": {'replicated' if replicated else 'not replicated'}.**")]


def generated_problems(text: str) -> tuple[list[str], int]:
    """Every problem in a generated part, and how many verdicts were checked; a verdict the parsers miss is a problem."""
    cells = [(match, False) for match in CELL.finditer(text)] + [(match, True) for match in TREND.finditer(text)]
    welch = list(WELCH.finditer(text))
    tost_lines = list(TOST_LINE.finditer(text))
    e11_rows = [line for line in text.splitlines() if line.startswith("| E11 P")]
    e12_rows = [line for line in text.splitlines() if re.match(r"\| E12 [PS]\d: ", line)]  # not the Holm families' table
    rows = [line for line in text.splitlines() if line.startswith(("| P1: ", "| P2: "))]
    primary = [line for line in rows if len(columns(line)) == 11]  # E10-confirm's rows have 10 columns
    confirm = [line for line in rows if line not in primary]
    problems = [problem for match, trend in cells for problem in cell_problems(match, trend)]
    problems += [problem for match in tost_lines for problem in tost_line_problems(match)]
    problems += [problem for line in primary for problem in e10_row_problems(line)]
    problems += [problem for line in confirm for problem in e10_confirm_row_problems(line)]
    problems += replication_problems(text, confirm)
    problems += [problem for match in welch for problem in welch_problems(match)]
    problems += [problem for line in e11_rows for problem in e11_row_problems(line)]
    problems += [problem for line in e12_rows for problem in e12_row_problems(line)]
    checked = len(cells) + len(welch) + len(tost_lines) + len(rows) + len(e11_rows) + len(e12_rows)
    unparsed = len(CELL_VERDICT.findall(text)) + len(BOLD_VERDICT.findall(text)) - checked
    if unparsed:
        problems.append(f"{unparsed} verdicts in a form the checks do not read")
    return problems, checked


def readme_problems(text: str) -> tuple[list[str], int]:
    """Every problem in README.md's generated bullets: each claim's ``Holm p X, TOST ±m p Y: verdict`` against the
    rule, and every verdict word inside such a claim."""
    problems, checked = [], 0
    for line in text.splitlines():
        spans = []
        for match in FRAGMENT.finditer(line):
            spans.append(match.span())
            checked += 1
            try:
                margin = float(match.group("margin")) if match.group("margin") else None
                expected = rule(printed_p(match.group("p")), MIN_SEEDS, margin,
                                printed_p(match.group("tost")) if margin is not None else math.nan)
            except ValueError as error:
                problems.append(f"{match.group(0)}: {error}")
                continue
            if margin is not None and expected.startswith("no difference larger than"):
                expected = f"no difference larger than {match.group('margin')}"  # as printed: 0.002, not 0.00
            if match.group("verdict") != expected:
                problems.append(f"{match.group(0)}: the rule gives {expected!r}")
        for word in README_WORDS.finditer(line):
            if not any(start <= word.start() < end for start, end in spans):
                problems.append(f"{line.strip()[:80]}…: {word.group(0)!r} outside a claim with its tests")
    return problems, checked


def between(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) : text.index(end)]


@pytest.fixture(scope="module")
def generated() -> str:
    return between(DOC.read_text(), "<!-- generated by benchmarks/study/experiments.py", "<!-- end of generated part -->")


@pytest.fixture(scope="module")
def bullets() -> str:
    return between(README.read_text(), "<!-- generated from the experiment JSON", "<!-- end of generated numbers -->")


def test_every_generated_verdict_follows_from_its_row(generated):
    problems, checked = generated_problems(generated)
    assert not problems, "\n".join(problems)
    assert checked > 100  # every table of E1–E10 and E10-confirm (155 verdicts in round 4)


def test_every_readme_verdict_follows_from_its_tests(bullets):
    problems, checked = readme_problems(bullets)
    assert not problems, "\n".join(problems)
    assert checked >= 10


def test_no_comparison_is_called_a_null(generated, bullets):
    assert not re.search(r"\bnulls?\b|\bno effect\b", generated + bullets)


# the labels the rule replaced, as the report printed them before round 4: each check must catch its own
OLD_E9_CELL = "-0.028 ± 0.027 (null; p 0.044, Holm 0.22; MDE 0.037; n=10)"  # interval excludes 0, reaches −0.055
OLD_EFFECT_CELL = "0.110 ± 0.021 (effect; p <0.001, Holm <0.001; n=5)"  # an effect that printed no MDE
OLD_E10_ROW = ("| P2: preference entropy (end) (±0.10) | `DFPOMin-SharedNoise` − `DFPOMin` | all | 30 | -0.100 ± 0.075 | 0.011 "
               "| 0.042 | 0.50, Holm 1.00 | not shown | – | **effect** |")
OLD_README = "reward-balanced − shuffled −0.028 ± 0.027 (Holm p 0.22, no effect);"


@pytest.mark.parametrize("text", [OLD_E9_CELL, OLD_EFFECT_CELL, OLD_E10_ROW])
def test_the_checks_catch_the_labels_the_rule_replaced(text):
    problems, _ = generated_problems(text)
    assert problems


def test_the_checks_catch_a_claim_with_the_wrong_verdict():
    assert readme_problems(OLD_README)[0]
    assert readme_problems("(Holm p 0.22, TOST ±0.04 p 0.17: no difference larger than 0.04)")[0]
    assert not readme_problems("(Holm p 0.22, TOST ±0.04 p 0.17: inconclusive)")[0]
    wrong = "-0.028 ± 0.027 (no difference larger than 0.04; p 0.044, Holm 0.22; TOST ±0.04 p 0.012; MDE 0.037; n=10)"
    assert any("90% interval" in problem for problem in generated_problems(wrong)[0])  # its interval reaches −0.050


# ----------------------------------------------------------------------------------------------- the claims' prose
AGENTS = ROOT / "docs" / "agents.md"
CONFOUNDED = {
    # a contrast: (the pre-registration's sentence that calls it confounded, the phrasings that name one cause for it)
    "E11 P2": ("a difference in GRPO's tax between them cannot be put down to first-turn agreement alone",
               re.compile(r"\b(?:where|when|because|since|if)\b[^.;|()]{0,40}\b(?:first turns?|episodes|groups?)\b"
                          r"[^.;|()]{0,30}\b(?:agree|open the same way)", re.I)),
}
RATIO = re.compile(r"\d×|\border of magnitude\b|\b(?:times|fold) (?:larger|smaller|more|less|what)\b")
SETTINGS = {  # the settings experiments ran in, by the names the prose gives them
    "the scaffold task (E1–E10)": re.compile(r"\bE(?:[1-9]|10)\b|single-turn|scaffold", re.I),
    "the agent quickstart (E11)": re.compile(r"\bE1[12]\b|\bagent|tool-using|\bacross (?:the )?turns|multi-turn", re.I),
}
ONE_WARM_START = re.compile(r"4 points|larger than 0\.04|no success")  # E11's P3, shown from the agreeing warm start only


def sentences(text: str) -> list[str]:
    return [sentence for sentence in re.split(r"(?<=[.;?])\s+", text.strip()) if sentence]


def prose_blocks(text: str) -> list[list[str]]:
    """A Markdown text's prose as blocks of sentences: a table row (the sentences of its cells), a bullet, a paragraph;
    wrapped lines joined, headings and rules left out."""
    blocks, current = [], []

    def close() -> None:
        if current:
            blocks.append(sentences(" ".join(current)))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|"):
            close()
            if not set(stripped) <= set("|-: "):
                blocks.append([sentence for column in columns(stripped) for sentence in sentences(column)])
        elif not stripped or stripped.startswith("#"):
            close()
        else:
            if stripped.startswith("* "):
                close()
            current.append(stripped.removeprefix("* "))
    close()
    return blocks


def confound_problems(blocks: list[list[str]]) -> list[str]:
    return [f"{sentence[:90]}…: names one cause for {contrast}, a contrast its pre-registration calls confounded"
            for block in blocks for sentence in block for contrast, (_, cause) in CONFOUNDED.items() if cause.search(sentence)]


def ratio_problems(blocks: list[list[str]]) -> list[str]:
    problems = []
    for sentence in (sentence for block in blocks for sentence in block):
        named = [setting for setting, names in SETTINGS.items() if names.search(sentence)]
        if RATIO.search(sentence) and len(named) > 1:
            problems.append(f"{sentence[:90]}…: a ratio across experiments in different settings ({', '.join(named)})")
    return problems


def warm_start_problems(e11_blocks: list[list[str]]) -> list[str]:
    """E11's success claims (P3: GRPO − DFPOMin within 4 points) hold from the agreeing warm start only: every E11
    sentence that makes one names a warm start."""
    return [f"{sentence[:90]}…: an E11 success claim that does not say from which warm start"
            for block in e11_blocks for sentence in block if ONE_WARM_START.search(sentence) and "warm start" not in sentence]


def claim_verdict_problems(claims: str, generated_text: str) -> list[str]:
    """The claims table's E11 primary rows open their verdict with the generated table's verdict for that outcome."""
    verdicts = {columns(line)[0].split(":")[0]: columns(line)[-1] for line in generated_text.splitlines() if line.startswith("| E11 P")}
    problems = []
    for line in claims.splitlines():
        outcome = re.search(r"\((E11 P\d)\)", line)
        if line.startswith("|") and outcome and not columns(line)[-1].startswith(verdicts[outcome.group(1)]):
            problems.append(f"{outcome.group(1)}'s claim: {columns(line)[-1][:60]}…, the generated verdict is {verdicts[outcome.group(1)]}")
    return problems


@pytest.fixture(scope="module")
def claims() -> str:
    return between(DOC.read_text(), "### Claims and verdicts", "### Results")


@pytest.fixture(scope="module")
def agents_e11() -> str:
    return between(AGENTS.read_text(), "## Cancellation across turns", "## Writing an environment")


@pytest.fixture(scope="module")
def prose(claims, agents_e11, bullets) -> list[list[str]]:
    return prose_blocks(claims) + prose_blocks(agents_e11) + prose_blocks(bullets)


@pytest.fixture(scope="module")
def e11_prose(claims, agents_e11, bullets) -> list[list[str]]:
    """The prose about E11: round 4's claims (its table and what E11 adds), docs/agents.md's paragraph, the README bullet."""
    round4 = between(claims, "#### Round 4", "#### Round 3")
    return prose_blocks(round4) + prose_blocks(agents_e11) + [block for block in prose_blocks(bullets) if "E11" in block[0]]


def test_no_claim_names_one_cause_for_a_contrast_its_preregistration_calls_confounded(prose):
    preregistrations = DOC.read_text().split("### Claims and verdicts")[0]
    assert all(sentence in preregistrations for sentence, _ in CONFOUNDED.values())
    problems = confound_problems(prose)
    assert not problems, "\n".join(problems)


def test_no_claim_draws_a_ratio_across_experiments_in_different_settings(prose):
    problems = ratio_problems(prose)
    assert not problems, "\n".join(problems)
    assert any(RATIO.search(sentence) for block in prose for sentence in block)  # the ratios within one setting are read


def test_e11_success_claims_name_the_warm_start(e11_prose):
    problems = warm_start_problems(e11_prose)
    assert not problems, "\n".join(problems)
    assert any(ONE_WARM_START.search(sentence) for block in e11_prose for sentence in block)


def test_the_claims_give_e11s_primary_outcomes_their_generated_verdicts(claims, generated):
    problems = claim_verdict_problems(claims, generated)
    assert not problems, "\n".join(problems)
    assert len(re.findall(r"\(E11 P\d\) \|", claims)) == 3


# the E11 wording these checks replaced, as the claims, docs/agents.md and the README printed it: each check catches its own
OLD_E11_README = ("* **Cancellation across turns (E11, a tool-using agent, pre-registered, 10 seeds)**: on turns a whole group shares, "
                  "GRPO leaves 0.0270 ± 0.0016 of each update uncancelled, DFPOMin ≤ 3e-08 (Holm p <0.001: effect);\n"
                  "  where first turns agree more, 0.0085 ± 0.0019 more (Holm p <0.001: effect); success GRPO − DFPOMin −0.010 ± "
                  "0.020 (Holm p 0.28, TOST ±0.04 p 0.0035: no difference larger than 0.04).")
OLD_E11_AGENTS = ("In training (experiment E11, pre-registered, 10 seeds, [experiments.md](experiments.md)) GRPO on the agent quickstart\n"
                  "left 2.7% of each update uncancelled on shared turns (DFPOMin and DrGRPO 0), more where a group's first turns agree\n"
                  "more often, and in 40 steps no success difference larger than 4 points against DFPOMin.")
OLD_E11_ADDS = ("What E11 adds: across the turns of a tool-using agent the learning tax is real and an order of magnitude larger than\n"
                "on single-turn completions (2.7% of each update, against 0.07–0.31%), it grows where a group's episodes open the same\n"
                "way, and the objectives that cancel by design remove it. In 40 steps on this task it cost no success larger than\n"
                "4 points and no entropy difference was detected.")
OLD_E11_P1 = ("| does GRPO leave credit uncancelled on the turns a group of agent episodes shares? (E11 P1) | the agent quickstart | "
              "GRPO's learning tax **0.0270 ± 0.0016** | **reproduced, the predicted direction**: across turns GRPO's per-episode "
              "normaliser leaves 2.7% of each update uncancelled, 9–39× what it left on the single-turn scaffold task (E2: 0.07–0.31%) |")


def test_the_prose_checks_catch_the_e11_wording_they_replaced(generated):
    assert len(confound_problems(prose_blocks(OLD_E11_README + "\n\n" + OLD_E11_AGENTS + "\n\n" + OLD_E11_ADDS))) == 3
    assert len(ratio_problems(prose_blocks(OLD_E11_ADDS + "\n\n" + OLD_E11_P1))) == 2
    assert len(warm_start_problems(prose_blocks(OLD_E11_README + "\n\n" + OLD_E11_AGENTS + "\n\n" + OLD_E11_ADDS))) == 3
    assert claim_verdict_problems(OLD_E11_P1, generated)
    # the wording that replaced them passes
    new = ("from the warm start whose groups' first turns agree more often (which also starts surer and more successful), "
           "0.0085 ± 0.0019 more; from that warm start, success GRPO − DFPOMin −0.010 ± 0.020 (no difference larger than 0.04).")
    assert not confound_problems(prose_blocks(new)) and not warm_start_problems(prose_blocks(new))
    assert not ratio_problems(prose_blocks("GRPO's tax 0.102 ± 0.006 (untouched 6e-9; 43× E2's GRPO; Holm < 0.001)."))

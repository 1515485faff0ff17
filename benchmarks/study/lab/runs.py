"""The runs of the cancellation experiments: what each experiment runs, how a run is executed and stored, and replay.

A run is ``lit-cancel fit --config configs/scaffold.yaml`` (E11's: ``configs/quickstart-agent.yaml``) with command-line
overrides (:class:`Run`); :func:`execute` runs it and stores its TensorBoard scalars, command and provenance as one JSON
file in ``benchmarks/study/results/<experiment>/``; :func:`replay` reruns a stored run's command and
:func:`compare_scalars` says whether its scalars are bit-identical to the stored ones.
"""

import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# benchmarks/study: the lab package, forced_branching and the parts the runs load by class path
STUDY_DIR = Path(__file__).resolve().parents[1]
RESULTS = STUDY_DIR / "results"
CONFIG = "configs/scaffold.yaml"
TMP = "<tmp>"  # the logger folder in a stored command: a temporary folder of its own per run
WALL_CLOCK = "perf/"  # the series that time a run: they differ between any two runs


# ----------------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    """One ``lit-cancel fit``: an experiment's arm (the compared variant) at one setting and seed."""

    experiment: str
    arm: str
    setting: str
    seed: int
    overrides: tuple[str, ...] = field(compare=False)
    config: str = field(default=CONFIG, compare=False)

    @property
    def path(self) -> Path:
        return RESULTS / self.experiment / f"{self.arm}-{self.setting}-seed{self.seed}.json"

    def command(self, save_dir: str) -> list[str]:
        return [
            "lit-cancel", "fit", "--config", self.config, f"--seed_everything={self.seed}", f"--data.init_args.seed={self.seed}",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={save_dir}", "--trainer.logger.init_args.name=run",
            *self.overrides,
        ]


def knobs(scaffold: int, spread: int) -> list[str]:
    return [f"--data.init_args.task.init_args.scaffold={scaffold}", f"--data.init_args.task.init_args.spread={spread}"]


def budget(steps: int, lr: float, val_samples: int = 4) -> list[str]:
    # validation before training and after the last step only; curves come from the training rollouts
    return [f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", f"--model.init_args.val_samples={val_samples}",
            f"--model.init_args.optimizer.init_args.lr={lr}"]


def objective(name: str) -> list[str]:
    return [f"--model.init_args.objective=lit_cancel.{name}"]


def trust_region(name: str) -> list[str]:
    return [f"--model.init_args.objective.init_args.trust_region=lit_cancel.{name}"]


def off_policy(mu: int, mini_batches: int) -> list[str]:
    return [f"--data.init_args.epochs_per_round={mu}", f"--data.init_args.mini_batches_per_round={mini_batches}"]


PLANS = {"shuffled": "lit_cancel.Shuffled", "query_preserved": "lit_cancel.QueryPreserved", "reward_balanced": "lit_cancel.RewardBalanced"}
E2_SCAFFOLDS, E2_SPREADS = (0, 12, 24), (0, 4, 8)
# E1, E3, E4 and E5 run at one knob setting: scaffold 12, spread 8 (E2 found scaffold 24 unstable at these rates)
STUDY_SCAFFOLD, STUDY_SPREAD = 12, 8
STUDY = f"s{STUDY_SCAFFOLD}v{STUDY_SPREAD}"
E7_TRUST_REGIONS = ("TokenRatioMask", "GroupRatioDrop", "TokenRatioWeight")
# E8 starts from a shorter supervised warm-up (benchmarks/study/scaffold_warmstart.py), whose scaffold is not saturated
E8_WARMSTART_STEPS, E8_SCAFFOLD, E8_SPREAD, E8_LR = 150, 12, 8, 2e-4
E8_WARMSTART = f"benchmarks/study/results/E8/warmstart-{E8_WARMSTART_STEPS}"
E8_SETTING = f"s{E8_SCAFFOLD}v{E8_SPREAD}-warm{E8_WARMSTART_STEPS}"
E9_FLIP_SEEDS = 5
# E10 forces shared, uncertain tokens: one preamble sampled per prompt, the group's continuations branch from it
# (benchmarks/study/forced_branching.py); 30 seeds for the arms that decide the causal claim, 10 for the others
E10_SCAFFOLD, E10_SPREAD, E10_PREAMBLE, E10_PROMPTS, E10_STEPS, E10_LR = 0, 8, 8, 8, 40, 2e-4
E10_SETTING = f"s{E10_SCAFFOLD}v{E10_SPREAD}-K{E10_PREAMBLE}"
E10_SEEDS = {"DFPOMin": 30, "DFPOMin-SharedNoise": 30, "GRPO": 30, "DrGRPO": 10, "GSPO": 10, "DFPOMinTR": 10,
             "DFPOMin-PositiveOnly": 10}


# E10-confirm (pre-registered in docs/experiments.md): E10's untouched and noise arms on fresh seeds, as many as 80% power
# at E10's P2 margin (0.10 nats) needs at the paired SD E10 observed (0.200)
E10C_ARMS = ("DFPOMin", "DFPOMin-SharedNoise")
E10C_SEEDS = tuple(range(100, 134))


def e10_common() -> list[str]:
    """What every E10 run shares: the knobs, forced branching, its two probes, the batch and the budget."""
    return [
        *knobs(E10_SCAFFOLD, E10_SPREAD),
        "--model.init_args.engine=forced_branching.ForcedBranching",
        f"--model.init_args.engine.init_args.preamble_tokens={E10_PREAMBLE}",
        "--trainer.callbacks+=forced_branching.GroupSharedTokens",
        "--trainer.callbacks+=forced_branching.PreambleDrift",
        f"--data.init_args.prompts_per_round={E10_PROMPTS}",
        *budget(E10_STEPS, E10_LR),
    ]


def e10_arms(seed: int) -> dict[str, list[str]]:
    """The overrides of each E10 arm (pre-registered in docs/experiments.md)."""
    return {
        "DFPOMin": objective("DFPOMin"),
        "DFPOMin-SharedNoise": [
            *objective("DFPOMin"), "--model.init_args.objective.init_args.trust_region=lab.parts.SharedPositionNoise",
            "--model.init_args.objective.init_args.trust_region.init_args.sigma=1.0",
            f"--model.init_args.objective.init_args.trust_region.init_args.seed={seed}",
        ],
        "GRPO": objective("GRPO"),
        "DrGRPO": objective("DrGRPO"),
        "GSPO": objective("GSPO"),
        "DFPOMinTR": [*objective("DFPOMin"), *trust_region("TokenRatioMask"),
                      "--model.init_args.objective.init_args.trust_region.init_args.eps=0.2"],
        "DFPOMin-PositiveOnly": [*objective("DFPOMin"), "--model.init_args.objective.init_args.trust_region=lab.parts.AdvantageSign"],
    }


# E11 (pre-registered in docs/experiments.md): cancellation across turns on the agent quickstart. The arms change the
# objective only; the knob is the warm start, the supervised agent recipe at two shares of tool-calling demonstrations,
# which sets how often a group's episodes open with the same turn (the environment cannot change the first turn)
AGENT_CONFIG, SFT_AGENT_CONFIG = "configs/quickstart-agent.yaml", "configs/sft-agent.yaml"
E11_ARMS = ("GRPO", "DrGRPO", "DFPOMin")
E11_SEEDS = tuple(range(10))
E11_STEPS, E11_LR = 40, 2e-4
E11_TOOL_SHARES = {"mixed": 0.5, "agreeing": 0.95}


def e11_setting(warm_start: str) -> str:
    return f"{warm_start}-tool{round(E11_TOOL_SHARES[warm_start] * 100)}"


def e11_warmstart(warm_start: str) -> str:
    """The folder, relative to the repository root, that :func:`ensure_warmstart` trains ``warm_start`` into."""
    return f"benchmarks/study/results/E11/warmstart-{e11_setting(warm_start)}"


def e11_overrides(warm_start: str, arm: str) -> tuple[str, ...]:
    """An E11 run's overrides of configs/quickstart-agent.yaml: its warm start, its objective (the config's other
    settings, clip 0.2 and no KL, carry over where the class takes them), the budget and the manipulation check."""
    return (f"--model.init_args.model_path={e11_warmstart(warm_start)}", *objective(arm), *budget(E11_STEPS, E11_LR),
            "--trainer.callbacks+=lab.parts.FirstTurnAgreement")



# E12 (pre-registered in docs/experiments.md): does agreement itself raise GRPO's tax? From each of E11's warm starts, a
# group's episodes forced to share their first turn (forced_branching.ForcedFirstTurn) against E11's independent episodes
E12_SEEDS = {"GRPO-forced": tuple(range(200, 226)), "GRPO-independent": tuple(range(200, 226)),
             "DFPOMin-forced": tuple(range(200, 205))}
E12_PILOT_SEED = 1000


def e12_overrides(warm_start: str, arm: str) -> tuple[str, ...]:
    """An E12 run's overrides: E11's run of the arm's objective at ``warm_start``, and for a forced arm the forcing engine
    (groups of the config's 8 episodes) and its count of groups that end at their shared first turn."""
    objective_name, sampling = arm.split("-")
    forced = ("--model.init_args.engine=forced_branching.ForcedFirstTurn", "--model.init_args.engine.init_args.group_size=8",
              "--trainer.callbacks+=lab.parts.FinalFirstTurn")
    return (*e11_overrides(warm_start, objective_name), *(forced if sampling == "forced" else ()))


def e12_pilot_overrides(warm_start: str, arm: str) -> tuple[str, ...]:
    """E12's check before its main runs: 4 steps at a learning rate too small to move the policy, no validation."""
    return (*e12_overrides(warm_start, arm), "--trainer.max_steps=4", "--model.init_args.optimizer.init_args.lr=1e-12",
            "--trainer.limit_val_batches=0")

def sft_agent_command(tool_share: float, output_dir: str, save_dir: str) -> list[str]:
    """configs/sft-agent.yaml (the recipe of the shipped ``embedded:tiny-agent``) at ``tool_share``, saved to ``output_dir``."""
    return ["lit-cancel", "fit", "--config", SFT_AGENT_CONFIG, f"--data.init_args.task.init_args.tool_share={tool_share}",
            f"--model.init_args.output_dir={output_dir}", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={save_dir}", "--trainer.logger.init_args.name=run"]


def experiment_runs(name: str, seeds: list[int]) -> list[Run]:
    """Every run of experiment ``name`` for ``seeds``. The settings and their reasons are in docs/experiments.md."""
    if name == "E10C":  # its seeds are fixed by its pre-registration, whatever ``seeds`` says
        return [Run(name, arm, E10_SETTING, seed, (*e10_common(), *chosen))
                for seed in E10C_SEEDS for arm, chosen in e10_arms(seed).items() if arm in E10C_ARMS]
    if name == "E11":  # likewise
        return [Run(name, arm, e11_setting(warm_start), seed, e11_overrides(warm_start, arm), AGENT_CONFIG)
                for warm_start in E11_TOOL_SHARES for seed in E11_SEEDS for arm in E11_ARMS]
    if name == "E12":  # likewise
        return [Run(name, arm, e11_setting(warm_start), seed, e12_overrides(warm_start, arm), AGENT_CONFIG)
                for warm_start in E11_TOOL_SHARES for arm, arm_seeds in E12_SEEDS.items() for seed in arm_seeds]
    if name == "E12P":  # E12's pilot check, at a seed outside the confirmatory ones
        return [Run(name, arm, e11_setting(warm_start), E12_PILOT_SEED, e12_pilot_overrides(warm_start, arm), AGENT_CONFIG)
                for warm_start in E11_TOOL_SHARES for arm in ("GRPO-forced", "GRPO-independent")]
    runs = []
    for seed in seeds:
        if name == "E1":  # exchangeability: five objectives at mu = 2, one knob setting; GRPO and DFPOMin also at half the rate
            arms = [(arm, 1e-4) for arm in ("GRPO", "GSPO", "DrGRPO", "DFPOMin", "DFPOOrth")] + [("GRPO", 5e-5), ("DFPOMin", 5e-5)]
            for arm, lr in arms:
                setting = f"{STUDY}-mu2" + ("" if lr == 1e-4 else f"-lr{lr:g}")
                runs.append(Run(name, arm, setting, seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective(arm), *off_policy(2, 2), *budget(60, lr),
                )))
        elif name == "E2":  # dose-response: GRPO and DFPOMin over scaffold x spread, on-policy, 8 prompts x 8 per step
            for scaffold, spread, arm in itertools.product(E2_SCAFFOLDS, E2_SPREADS, ("GRPO", "DFPOMin")):
                runs.append(Run(name, arm, f"s{scaffold}v{spread}", seed, (
                    *knobs(scaffold, spread), *objective(arm), "--data.init_args.prompts_per_round=8", *budget(40, 2e-4),
                )))
        elif name == "E3":  # token flipping under GRPO on-policy (the config measures every 10 steps)
            runs.append(Run(name, "GRPO", STUDY, seed, (*knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective("GRPO"), *budget(60, 2e-4))))
        elif name == "E4":  # batching plans at mu = 1, 2, 4 with GRPO
            for mu, plan in itertools.product((1, 2, 4), PLANS):
                runs.append(Run(name, plan, f"{STUDY}-mu{mu}", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective("GRPO"), *off_policy(mu, 4), f"--data.init_args.plan={PLANS[plan]}",
                    *budget(60, 2e-4 / mu),
                )))
        elif name == "E5":  # group size at 128 rollouts per step
            for group, arm in itertools.product((2, 4, 8, 16), ("GRPO", "GSPO", "DFPOMin")):
                runs.append(Run(name, arm, f"{STUDY}-G{group}", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective(arm), *off_policy(2, 2), f"--data.init_args.group_size={group}",
                    f"--data.init_args.prompts_per_round={128 // group}", *budget(60, 1e-4),
                )))
        elif name == "E7":  # does DFPO with a trust region that keeps cancelling beat GRPO? E1's off-policy setting
            arms = {arm: objective(arm) for arm in ("GRPO", "DrGRPO", "DFPOMin")}
            arms |= {f"DFPOMin-{region}": [*objective("DFPOMin"), *trust_region(region)] for region in E7_TRUST_REGIONS}
            for arm, chosen in arms.items():
                runs.append(Run(name, arm, f"{STUDY}-mu2", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *chosen, *off_policy(2, 2), *budget(60, 1e-4, val_samples=8),
                )))
        elif name == "E8":  # a causal test of the learning tax: break cancellation on shared positions only, on-policy
            arms = {
                "DFPOMin": [],
                "DFPOMin-SharedNoise": [
                    "--model.init_args.objective.init_args.trust_region=lab.parts.SharedPositionNoise",
                    f"--model.init_args.objective.init_args.trust_region.init_args.seed={seed}",
                ],
                "DFPOMin-PositiveOnly": ["--model.init_args.objective.init_args.trust_region=lab.parts.AdvantageSign"],
            }
            for arm, chosen in arms.items():
                runs.append(Run(name, arm, E8_SETTING, seed, (
                    *knobs(E8_SCAFFOLD, E8_SPREAD), f"--model.init_args.model_path={E8_WARMSTART}", *objective("DFPOMin"), *chosen,
                    "--trainer.callbacks+=lab.parts.ScaffoldProbe", *budget(40, E8_LR, val_samples=8),
                )))
        elif name == "E9":  # paper B at full dose: batching plans at mu = 4, 8 mini-batches; token flips by confidence
            for plan, class_path in {**PLANS, "sign_sorted": "lab.parts.SignSorted"}.items():
                runs.append(Run(name, plan, f"{STUDY}-mu4-mb8", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective("GRPO"), *off_policy(4, 8), f"--data.init_args.plan={class_path}",
                    *budget(128, 5e-5, val_samples=8),
                )))
            if seed < E9_FLIP_SEEDS:  # E3's setting; the one-sign arms train on one sign of advantage only
                for arm, keep in {"GRPO": None, "GRPO-PositiveOnly": "positive", "GRPO-NegativeOnly": "negative"}.items():
                    chosen = [] if keep is None else [
                        "--model.init_args.objective.init_args.trust_region=lab.parts.AdvantageSign",
                        f"--model.init_args.objective.init_args.trust_region.init_args.keep={keep}",
                    ]
                    runs.append(Run(name, arm, f"{STUDY}-flips", seed, (
                        *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), "--model.init_args.objective=lit_cancel.PolicyGradient", *chosen,
                        *budget(60, 2e-4),
                    )))
        elif name == "E10":  # Prop. 3.1's causal test on shared tokens that are also uncertain: forced branching
            runs += [Run(name, arm, E10_SETTING, seed, (*e10_common(), *chosen))
                     for arm, chosen in e10_arms(seed).items() if seed < E10_SEEDS[arm]]
        else:
            raise ValueError(f"unknown experiment {name!r}; expected one of {EXPERIMENTS}")
    return runs


EXPERIMENTS = ("E1", "E2", "E3", "E4", "E5", "E7", "E8", "E9", "E10", "E10C", "E11", "E12", "E12P")
CHECKS = ("E12P",)  # runs that check an experiment's setup before its main runs: no arms of their own
PROBES = ("E6",)


def probe_path(seed: int) -> Path:
    return RESULTS / "E6" / f"probe-seed{seed}.json"


def run_probe(seed: int, threads: int | None = None) -> None:
    """E6 for one seed (``coupling_probe.probe``, in this process), stored as JSON."""
    import torch
    from coupling_probe import probe

    if threads:
        torch.set_num_threads(threads)
    path = probe_path(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(probe(seed), indent=1))
    partial.rename(path)


def scalars(log_dir: Path) -> dict[str, list[list[float]]]:
    """Every scalar the run logged to TensorBoard, as ``[step, value]`` pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [[e.step, float(f"{e.value:.6g}")] for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def pip_freeze() -> list[str]:
    """``pip freeze`` of the running interpreter, one line per package (empty when pip is missing)."""
    result = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if line.strip()] if result.returncode == 0 else []


def provenance(threads: int | None) -> dict:
    """What a run's numbers depend on beyond its command: they replay bit for bit only on the same commit and machine."""
    import platform

    import torch

    from lit_cancel.float32_products import cpu_identity

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"commit": commit + ("+modified" if dirty.strip() else ""), "torch": torch.__version__, **cpu_identity(),
            "cores": os.cpu_count(), "threads": threads or torch.get_num_threads(), "python": platform.python_version(),
            "pip_freeze": pip_freeze()}


def fit(command: list[str], threads: int | None = None) -> tuple[dict[str, list[list[float]]], float, str]:
    """Runs a ``lit-cancel fit`` command whose logger folder is the placeholder ``<tmp>``; returns its scalars, its
    wall time and the command as stored (``<tmp>`` in place of the temporary folder)."""
    # lab.parts (E8, E9; experiment_parts in the commands stored before the package) loads by class path from here
    path = os.pathsep.join(filter(None, [str(STUDY_DIR), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with tempfile.TemporaryDirectory() as save_dir:
        concrete = [part.replace(TMP, save_dir) for part in command]
        started = time.perf_counter()
        result = subprocess.run(concrete, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"lit-cancel failed:\n{result.stderr[-3000:]}")
        (log_dir,) = Path(save_dir, "run").glob("version_*")
        return scalars(log_dir), wall, " ".join(command)



def execute(run: Run, threads: int | None = None) -> None:
    """Runs ``run`` through the CLI and writes its JSON (config, command, wall time, provenance, scalars)."""
    try:
        logged, wall, command = fit(run.command(TMP), threads)
    except RuntimeError as error:
        raise RuntimeError(f"{run.path.name}: {error}") from None
    record = {"experiment": run.experiment, "arm": run.arm, "setting": run.setting, "seed": run.seed, "command": command,
              "wall_s": round(wall, 1), "provenance": provenance(threads), "scalars": logged}
    if weights := model_sha256(command):
        record["model_sha256"] = weights
    run.path.parent.mkdir(parents=True, exist_ok=True)
    partial = run.path.with_suffix(".part")
    partial.write_text(json.dumps(record, separators=(",", ":")))
    partial.rename(run.path)


def model_sha256(command: str) -> str | None:
    """The SHA-256 of the weights a command starts from, where its ``model_path`` is a folder of the repository (a warm
    start); None otherwise."""
    import hashlib

    for part in shlex.split(command):
        if part.startswith("--model.init_args.model_path="):
            weights = ROOT / part.split("=", 1)[1] / "model.safetensors"
            return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
    return None


def build_e11_warmstart(warm_start: str, threads: int | None = None) -> None:
    """Trains E11's ``warm_start`` by configs/sft-agent.yaml at its tool share and stores beside it a JSON of the command,
    the provenance, the recipe's scalars and the SHA-256 of the weights it saved. A record stored already (E11's own,
    in the repository) is kept: the runs made from a rebuilt warm start store its weights' SHA-256 (:func:`execute`),
    so the report can say whether they started from E11's weights."""
    import hashlib

    folder = ROOT / e11_warmstart(warm_start)
    logged, wall, command = fit(sft_agent_command(E11_TOOL_SHARES[warm_start], e11_warmstart(warm_start), TMP), threads)
    if folder.with_suffix(".json").exists():
        return
    weights = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    record = {"warm_start": warm_start, "tool_share": E11_TOOL_SHARES[warm_start], "command": command, "wall_s": round(wall, 1),
              "model_sha256": weights, "provenance": provenance(threads), "scalars": logged}
    folder.with_suffix(".json").write_text(json.dumps(record, separators=(",", ":")))


def ensure_warmstart(commands: list[str], threads: int | None = None) -> None:
    """Trains the warm starts the commands name that are missing: E8's short one (benchmarks/study/scaffold_warmstart.py)
    and E11's (:func:`build_e11_warmstart`)."""
    if any(E8_WARMSTART in command for command in commands) and not (ROOT / E8_WARMSTART).exists():
        from scaffold_warmstart import train

        train(E8_WARMSTART_STEPS)
    for warm_start in E11_TOOL_SHARES:
        named = any(f"model_path={e11_warmstart(warm_start)}" in command for command in commands)
        if named and not (ROOT / e11_warmstart(warm_start)).exists():
            build_e11_warmstart(warm_start, threads)


# ----------------------------------------------------------------------------------------------- replay
def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # nan equals nan here


def without_timings(scalars: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """``scalars`` without the wall-clock series (``perf/…``), which no rerun repeats."""
    return {tag: points for tag, points in scalars.items() if not tag.startswith(WALL_CLOCK)}


def compare_scalars(stored: dict[str, list[list[float]]], replayed: dict[str, list[list[float]]]) -> dict:
    """Whether two runs' scalars are identical, point for point (steps and values, at the stored precision).

    Returns ``{"identical", "tags", "missing", "extra", "differ"}``: the tags only the stored run has, those only
    the replay has, and per differing tag ``{"first_step", "stored", "replayed", "points"}``: the first step whose
    value (or step) differs, both values there (None past a series' end), and how many points differ.
    """
    missing = sorted(set(stored) - set(replayed))
    extra = sorted(set(replayed) - set(stored))
    differ = {}
    for tag in sorted(set(stored) & set(replayed)):
        a, b = stored[tag], replayed[tag]
        unequal = [i for i in range(max(len(a), len(b)))
                   if i >= len(a) or i >= len(b) or not (_same(a[i][0], b[i][0]) and _same(a[i][1], b[i][1]))]
        if unequal:
            first = unequal[0]
            step = a[first][0] if first < len(a) else b[first][0]
            differ[tag] = {"first_step": step, "stored": a[first][1] if first < len(a) else None,
                           "replayed": b[first][1] if first < len(b) else None, "points": len(unequal)}
    return {"identical": not (missing or extra or differ), "tags": len(stored), "missing": missing, "extra": extra,
            "differ": differ}


def describe_comparison(comparison: dict) -> list[str]:
    """The lines ``--replay`` prints for :func:`compare_scalars`' result."""
    if comparison["identical"]:
        return [f"bit-identical: all {comparison['tags']} scalar series equal the stored ones, point for point"]
    lines = [f"NOT identical: {len(comparison['differ'])} of {comparison['tags']} series differ"]
    if comparison["differ"]:
        first = min(comparison["differ"].values(), key=lambda d: d["first_step"])["first_step"]
        lines.append(f"first differing step: {first}")
    lines += [f"  {tag}: from step {d['first_step']} ({d['stored']} stored, {d['replayed']} replayed), {d['points']} points"
              for tag, d in sorted(comparison["differ"].items(), key=lambda item: (item[1]["first_step"], item[0]))]
    lines += [f"  only stored: {tag}" for tag in comparison["missing"]] + [f"  only replayed: {tag}" for tag in comparison["extra"]]
    return lines


# the folders that moved since runs were stored, as their commands name them (relative to the repository root)
MOVED = {"benchmarks/experiments/": "benchmarks/study/results/"}


def current_paths(command: str) -> str:
    """A stored command with the folders it names (E8's warm start) where they are now."""
    for before, now in MOVED.items():
        command = command.replace(before, now)
    return command


def replay(path: Path, threads: int | None = None) -> dict:
    """Reruns a stored run's command (same overrides and seed; its stored thread count unless ``threads``) and
    compares the scalars with the stored ones, wall-clock timings (``perf/…``) aside; returns :func:`compare_scalars`'
    result with the provenance of both."""
    record = json.loads(Path(path).read_text())
    stored = current_paths(record["command"])
    command = shlex.split(stored)
    stored_provenance = record.get("provenance", {})
    threads = threads or stored_provenance.get("threads")
    ensure_warmstart([stored], threads)
    logged, wall, _ = fit(command, threads)
    comparison = compare_scalars(without_timings(record["scalars"]), without_timings(logged))
    now = provenance(threads)
    keys = ("commit", "torch", "cpu", "cores", "threads", "python")
    comparison["provenance"] = {key: (stored_provenance.get(key), now.get(key)) for key in keys}
    comparison["wall_s"] = round(wall, 1)
    return comparison

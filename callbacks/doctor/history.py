"""A run's TensorBoard event files as a :class:`~lit_cancel.callbacks.doctor.diagnoses.RunHistory`, under lit_cancel's names.

Reads the runs of lit_cancel, of TRL's ``GRPOTrainer`` (``report_to="tensorboard"``) and of verl (``trainer.logger``
with ``tensorboard``); the framework is told by the tags. Each framework's tags are mapped to the names of
:data:`~lit_cancel.callbacks.doctor.diagnoses.SERIES` by one table, :data:`TAGS`; a tag whose quantity differs from ours in
meaning or unit is left unmapped, and the table says why. Steps are the steps the framework logged at: lit_cancel's and
TRL's optimizer steps, verl's training steps (one batch of rollouts each, which may hold several optimizer steps).
"""

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from google.protobuf.message import DecodeError
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from .diagnoses import SERIES, RunHistory

# per framework, its tag (or a pattern of tags) -> the canonical series it is
TAGS: dict[str, dict[str, str]] = {
    # its own names, and Lightning's LearningRateMonitor (lr-AdamW, lr-AdamW/pg1, ...: the first group's when several)
    "lit_cancel": {"lr-*": "lr"},
    # TRL 1.16 GRPOTrainer (trl/trainer/grpo_trainer.py _metrics, prefixed train/ by transformers' rewrite_logs),
    # each the mean over the logging_steps optimizer steps it logs at. Left unmapped: train/reward_std (no canonical
    # series), train/rewards/<function>/mean (one reward function's), eval/* (the eval reward is no held-out accuracy)
    # and train/sampling/importance_sampling_ratio/*.
    "trl": {
        "train/reward": "rollout/reward_mean",
        # share of samples whose group has equal rewards = share of groups (groups are of one size); with
        # scale_rewards="batch" or multi_objective_aggregation="normalize_then_sum" it is the whole batch's (0 or 1)
        "train/frac_reward_zero_std": "rollout/frac_zero_std_groups",
        "train/completions/mean_length": "rollout/completion_len",  # tokens
        "train/completions/clipped_ratio": "rollout/frac_truncated",  # the last token is not EOS or padding
        "train/kl": "loss/kl",  # k3 estimate to the reference, per token; logged only with beta > 0
        "train/entropy": "health/entropy",
        "train/clip_ratio/low_mean": "objective/clip_frac_low",  # ratio < 1 - epsilon_low with a negative advantage
        "train/clip_ratio/high_mean": "objective/clip_frac_high",  # ratio > 1 + epsilon_high with a positive advantage
        "train/clip_ratio/region_mean": "objective/clip_frac",
        "train/grad_norm": "health/grad_norm",  # transformers' Trainer: the norm clip_grad_norm_ returns, before clipping
        "train/learning_rate": "lr",
        # with vLLM and vllm_importance_sampling_correction: mean |trainer log-prob - vLLM log-prob| per token
        "train/sampling/sampling_logp_difference/mean": "rollout/logprob_mismatch",
    },
    # verl (verl/trainer/ppo/metric_utils.py compute_data_metrics, core_algos.compute_policy_loss_vanilla,
    # workers/actor/dp_actor.py update_policy, ray_trainer.py). Left unmapped:
    # critic/rewards/mean (the score less the KL penalty of use_kl_in_reward: critic/score/mean is the reward);
    # actor/pg_clipfrac_lower (the dual clip's share, ratio above clip_ratio_c with a negative advantage, not 1 - eps);
    # actor/kl_loss (its scale depends on the version and the batch split: summed over a step's mini-batches and PPO
    # epochs since v0.7.0, multiplied by the micro-batch count before); training/rollout_probs_diff_mean (a difference
    # of probabilities, not of log-probabilities); rollout_corr/* (one name for the trainer's and the actor's measures
    # of the rollout mismatch, the latter after updates); val-core/* (per data source and reward variable).
    "verl": {
        "critic/score/mean": "rollout/reward_mean",  # the reward function's score per sequence
        "response_length/mean": "rollout/completion_len",  # tokens
        "response_length/clip_ratio": "rollout/frac_truncated",  # responses of max_response_length tokens
        "actor/entropy": "health/entropy",  # aggregated by actor.loss_agg_mode (token-mean: per token)
        "actor/pg_clipfrac": "objective/clip_frac",  # tokens whose clipped loss is the larger: both sides
        # mean of log pi_old - log pi_new (k1); lit_cancel logs the k2 estimate of the same KL
        "actor/ppo_kl": "objective/approx_kl",
        "actor/reward_kl_penalty": "loss/kl",  # use_kl_in_reward: KL to the reference per token (algorithm.kl_penalty)
        "actor/grad_norm": "health/grad_norm",  # before clipping, the mean over the step's mini-batches
        "actor/lr": "lr",
    },
}
# where the settings of :data:`SETTINGS` are: lit_cancel's config.yaml (dotted keys), TRL's arguments (the "args" text)
LIT_CANCEL_SETTINGS = {
    "model.init_args.temperature": "temperature",
    "model.init_args.max_new_tokens": "max_new_tokens",
    "model.init_args.objective.init_args.kl_coef": "kl_coef",
    "model.init_args.engine.init_args.max_staleness": "max_staleness",
    "data.init_args.task.init_args.max_turns": "max_turns",  # an agent task's limits (lit_cancel.agents.AgentTask)
    "data.init_args.task.init_args.max_turn_tokens": "max_turn_tokens",  # null (the module's max_new_tokens) is not read
    "data.init_args.task.init_args.max_episode_tokens": "max_episode_tokens",
    "data.init_args.max_failed_share": "max_failed_share",  # the failure budget of an agent task's episodes
}
TRL_SETTINGS = {"temperature": "temperature", "max_completion_length": "max_new_tokens", "beta": "kl_coef"}
TRL_ARGS_TAG = "args/text_summary"  # transformers' TensorBoardCallback writes the TrainingArguments as JSON text


class RunReadError(Exception):
    """A run folder that cannot be read: missing, without event files, unreadable, or of no known framework."""


def event_files(folder: str | Path) -> list[Path]:
    """The TensorBoard event files under ``folder`` (any depth), by name."""
    return sorted(path for path in Path(folder).rglob("*tfevents*") if path.is_file())


def read_run(folder: str | Path) -> RunHistory:
    """The scalars of the run whose event files lie under ``folder``, under the names of ``SERIES``.

    A run may have several event files in its folder (lit_cancel's validation before fit writes one, a resumed run
    another), read in the order they were begun: a file's points of a tag replace the earlier files' points of that
    tag from its first step on (a resumed run logs its steps again), and the last value logged at a step is kept.
    Tags not in the framework's table keep their own names (lit_cancel's are the canonical ones); a foreign tag
    spelled like a canonical name is dropped. A run still writing is read as far as it is flushed.

    Raises:
        RunReadError: ``folder`` is missing, holds no event files, holds those of several runs (in several folders),
            cannot be read, or holds no scalar of lit_cancel, TRL or verl.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise RunReadError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    files = event_files(folder)
    if not files:
        raise RunReadError(f"{folder}: no TensorBoard event files (events.out.tfevents.*) in it or below it")
    run_folders = sorted({str(path.parent.relative_to(folder)) for path in files})
    if len(run_folders) > 1:
        raise RunReadError(f"{folder}: the event files of {len(run_folders)} runs ({', '.join(run_folders)}): name one of them")
    accumulators = [_load(path) for path in files]
    accumulators = sorted((a for a in accumulators if a is not None), key=lambda a: a.FirstEventTimestamp())
    points: dict[str, list[tuple[int, float]]] = {}
    for events in accumulators:
        for tag in events.Tags()[SCALARS]:
            logged = [(event.step, event.value) for event in events.Scalars(tag)]
            if logged:
                restart = min(step for step, _ in logged)
                points[tag] = [point for point in points.get(tag, []) if point[0] < restart] + logged
    if not points:
        raise RunReadError(f"{folder}: its event files hold no scalars yet")
    framework = detect_framework(points)
    if framework is None:
        tags = ", ".join(sorted(points)[:5]) + (", ..." if len(points) > 5 else "")
        raise RunReadError(f"{folder}: no scalar of lit_cancel, TRL or verl among its tags ({tags})")
    if framework == "lit_cancel":
        settings = _lit_cancel_settings(files[0].parent / "config.yaml")
    else:
        settings = _trl_settings(accumulators) if framework == "trl" else {}
    return RunHistory.from_points(canonical(points, framework), settings=settings, framework=framework)


def canonical_name(tag: str, framework: str) -> str | None:
    """The canonical name of ``tag`` in ``framework``'s table; the tag itself where the table does not name it, and None
    for a foreign tag spelled like a canonical name."""
    for source, name in TAGS[framework].items():
        if fnmatch.fnmatchcase(tag, source):
            return name
    return tag if framework == "lit_cancel" or tag not in SERIES else None


def canonical(points: Mapping[str, list[tuple[int, float]]], framework: str) -> dict[str, list[tuple[int, float]]]:
    """``points`` under their canonical names; where several tags map to one name, the first tag by name."""
    renamed: dict[str, list[tuple[int, float]]] = {}
    for tag in sorted(points):
        name = canonical_name(tag, framework)
        if name is not None and name not in renamed:
            renamed[name] = points[tag]
    return renamed


def detect_framework(tags: Mapping[str, Any]) -> str | None:
    """The framework with the most of its own tags among ``tags`` (lit_cancel's: the canonical names); None when
    there is none of any."""
    own = {framework: set(SERIES) if framework == "lit_cancel" else set(table) for framework, table in TAGS.items()}
    counts = {framework: len(names & set(tags)) for framework, names in own.items()}
    best = max(counts, key=counts.get)
    return best if counts[best] > 0 else None


def _load(path: Path) -> EventAccumulator | None:
    """The events of one file (every scalar, the defaults of the other kinds); None for a file still empty."""
    events = EventAccumulator(str(path), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
    try:
        events.Reload()  # stops before a record that is not yet written whole
    except (OSError, DecodeError) as error:
        raise RunReadError(f"{path}: cannot be read ({error})") from error
    try:
        events.FirstEventTimestamp()
    except ValueError:
        if path.stat().st_size == 0:
            return None
        # a writer writes and flushes its first record as it opens the file
        raise RunReadError(f"{path}: cannot be read (not a TensorBoard event file, or its first record is corrupt)") from None
    return events


def _lit_cancel_settings(config: Path) -> dict[str, float]:
    """The settings in a lit_cancel run's ``config.yaml`` (written by LightningCLI); none when it is missing."""
    try:
        values = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    settings = {}
    for key, name in LIT_CANCEL_SETTINGS.items():
        value = values
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            settings[name] = float(value)
    return settings


def _trl_settings(accumulators: list[EventAccumulator]) -> dict[str, float]:
    """The settings in the arguments TRL's trainer wrote as text (its ``GRPOConfig``, as JSON)."""
    for events in accumulators:
        if TRL_ARGS_TAG in events.Tags()["tensors"]:
            try:
                arguments = json.loads(events.Tensors(TRL_ARGS_TAG)[-1].tensor_proto.string_val[0])
            except (ValueError, IndexError):
                return {}
            return {
                name: float(arguments[key]) for key, name in TRL_SETTINGS.items()
                if isinstance(arguments.get(key), int | float) and not isinstance(arguments.get(key), bool)
            }
    return {}


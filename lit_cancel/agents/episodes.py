"""Episodes as one token sequence: the policy's turns as sampled, the environment's observations appended as ids.

Each turn, every episode still running is continued from its own tokens (prompt, earlier turns, observations), never
from re-tokenized text, so what the policy was conditioned on when it sampled is exactly what training reads. The
episode becomes one row of a :class:`~lit_cancel.rounds.sample.Generation`: its prompt left-padded, then its turns and
observations; ``attention_mask`` is one on all of them, ``completion_mask`` on the policy's tokens only, so that the
environment's tokens stay in the context and out of every credit and normaliser.

An episode ends when the environment says it is done, after ``max_turns`` turns, when a turn runs past
``max_turn_tokens`` without a stop token (the environment is not asked to read half a turn), or at
``max_episode_tokens`` (its last turn or observation cut there). It fails when its environment does (its factory,
``reset``, ``step`` or ``reward`` raises or answers with the wrong type, or its calls run past ``episode_timeout``): it is
marked with a :class:`~lit_cancel.rounds.failures.Failure` and its row is inert (no policy token in its completion mask,
no reward asked of the task), while the other episodes run on.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lit_cancel.agents.environment import (
    Environment,
    EnvironmentFailure,
    EpisodeClock,
    episode_reward,
    new_environment,
    reset_episode,
    step_episode,
)
from lit_cancel.rounds.failures import Failure
from lit_cancel.rounds.sample import Generation, padded
from lit_cancel.rounds.score import RewardError, checked_reward
from lit_cancel.tasks import Record

ENDINGS = ("done", "turn_limit", "turn_cut", "episode_cut")


@dataclass(frozen=True)
class EpisodeLimits:
    """How far an episode may run.

    Attributes:
        max_turns: turns of the policy at most.
        max_turn_tokens: tokens of one turn at most; the policy module's ``max_new_tokens`` when None.
        max_episode_tokens: tokens after the prompt at most, the policy's and the environment's together.
        episode_timeout: seconds the environment's calls of one episode may take in all (its factory, ``reset``, each
            ``step``, ``reward``); an episode whose calls run past it fails (a call that hangs is left running in a
            daemon thread). None: no limit, and the calls run in the episode's own thread.
    """

    max_turns: int = 4
    max_turn_tokens: int | None = None
    max_episode_tokens: int = 512
    episode_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_episode_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.episode_timeout is not None and not self.episode_timeout > 0:
            raise ValueError(f"episode_timeout must be > 0 seconds or None, got {self.episode_timeout!r}")


@dataclass
class Episode:
    """One episode as it runs: its prompt and its tokens, each from the policy or the environment."""

    prompt: list[int]
    environment: Environment | None
    where: str
    clock: EpisodeClock = field(default_factory=EpisodeClock)
    tokens: list[int] = field(default_factory=list)
    from_policy: list[bool] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_output_faults: int = 0
    turn_steps: list[int] = field(default_factory=list)
    ending: str | None = None
    failure: Failure | None = None

    def fail(self, error: EnvironmentFailure) -> None:
        """Marks the episode failed by ``error``: it takes no more turns, and its row will be inert."""
        self.failure, self.ending = Failure(error.cause, str(error)), "failed"

    def turn_texts(self) -> list[str]:
        """The policy's turns as text: the transcript alternates turn and observation, starting with a turn."""
        return self.transcript[0::2]

    def append_reply(self, text: str, max_episode_tokens: int, tokenizer) -> bool:
        """The environment's ``text`` appended as ids, cut at ``max_episode_tokens``; whether it filled the episode."""
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        room = max_episode_tokens - len(self.tokens)
        self.append(tokens[:room], False)
        self.transcript.append(text if len(tokens) <= room else tokenizer.decode(tokens[:room]))
        return len(tokens) >= room

    def append(self, tokens: list[int], from_policy: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.from_policy += [from_policy] * len(tokens)
        self.sampler_logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


@dataclass
class TurnCalls:
    """A round's engine calls, one a turn, each continuing running episodes from their token ids and keeping the engine
    for the next (released by the caller after the last): the seconds their weight pushes took, and the engine's
    statistics, ``perf/...`` summed over the calls, the others the last call's."""

    policy: object
    device: torch.device
    greedy: bool = False
    sync_seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def __call__(self, contexts: list[list[int]], max_new_tokens: int) -> Generation:
        """One call with ``contexts`` (a row each, left-padded); a process with none still makes it, with one pad row,
        since a sharded policy gathers its weights at each call and every process must make as many."""
        pad = self.policy.tokenizer.pad_token_id
        ids, mask = padded(contexts or [[pad]], pad, left=True)
        generation = self.policy.rollout(ids.to(self.device), mask.to(self.device), 1, self.greedy,
                                         max_new_tokens=max_new_tokens, keep_engine=True)
        self.sync_seconds += generation.sync_seconds
        self.stats = {k: self.stats.get(k, 0.0) + v if k.startswith("perf/") else v for k, v in generation.stats.items()}
        return generation


EpisodeScorer = Callable[[list[Record], list[Episode]], tuple[list[float], dict[str, float]]]
"""What scores finished episodes (``episodes[i]`` of ``records[i]``), their environments still at hand: a reward per
episode (NaN where the task's reward is to score it) and ``rollout/...`` statistics of the scoring."""


def run_episodes(policy, make_environment: Callable[[], Environment], limits: EpisodeLimits, records: list[Record],
                 input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1, greedy: bool = False,
                 names: Sequence[str] | None = None, score: EpisodeScorer | None = None) -> Generation:
    """``num_samples`` episodes of each of ``records`` (prompts left-padded in ``input_ids``), run turn by turn: each
    turn is one ``policy.rollout`` of every running episode, each answered by its own environment.

    ``policy`` is a :class:`~lit_cancel.rounds.sample.RolloutPolicy`; ``make_environment`` makes one environment per
    episode; ``names[i]`` names record ``i`` in the messages of a failing environment (``"val record 3"``,
    :func:`~lit_cancel.rounds.draw.record_names`; ``"record i"`` when None). Rows are ordered as
    ``policy.rollout`` orders them (sample ``k`` of record ``i`` at ``i * num_samples + k``); ``texts`` are the
    transcripts (turns and observations, stop tokens removed); ``rewards`` what ``score`` gives of the finished
    episodes, their environments at hand (the environments' own rewards when None, :func:`environment_rewards`; NaN where
    it gives none, for the task to score); ``stats`` the episodes' ``rollout/...`` statistics (:func:`episode_stats`),
    the engine's and ``score``'s.
    """
    tokenizer, device = policy.tokenizer, input_ids.device
    episodes = []
    for index, (record, ids, mask) in enumerate(zip(records, input_ids.cpu(), attention_mask.cpu(), strict=True)):
        where = names[index] if names is not None else f"record {index}"
        for _ in range(num_samples):
            episode = Episode(ids[mask.bool()].tolist(), None, where, EpisodeClock(limits.episode_timeout))
            try:
                episode.environment = new_environment(make_environment, f"for {where}", episode.clock)
                opening = reset_episode(episode.environment, record, where, episode.clock)
            except EnvironmentFailure as error:
                episode.fail(error)
            else:
                episode.prompt += tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else []
            episodes.append(episode)

    turn_tokens = limits.max_turn_tokens or policy.sampling_options().max_new_tokens
    stops = set(policy.stop_token_ids)
    calls = TurnCalls(policy, device, greedy)
    for turn in range(1, limits.max_turns + 1):
        running = [e for e in episodes if e.ending is None]
        if not running and not (dist.is_initialized() and dist.get_world_size() > 1):
            break
        room = max((limits.max_episode_tokens - len(e.tokens) for e in running), default=1)
        generation = calls([e.prompt + e.tokens for e in running], min(turn_tokens, room))
        for row, episode in enumerate(running):
            take_turn(episode, generation, row, turn, turn == limits.max_turns, limits, stops, tokenizer)
    policy.release_engine()  # the engine stayed as it was between turns (vLLM awake with the weights it was pushed)
    for episode in episodes:
        episode.ending = episode.ending or "turn_limit"

    repeated = [record for record in records for _ in range(num_samples)]
    if score is None:
        rewards, reward_stats = [scored(episode) for episode in episodes], {}
    else:
        rewards, reward_stats = survivors_scored(score, repeated, episodes)
    return as_generation(episodes, tokenizer.pad_token_id, device, rewards, calls.sync_seconds,
                         calls.stats | episode_stats(episodes) | reward_stats)


def survivors_scored(score: EpisodeScorer, records: list[Record], episodes: list[Episode]) -> tuple[list[float], dict[str, float]]:
    """``score`` of the episodes that did not fail; 0.0 for an episode that failed, or failed in the scoring (its
    environment's reward raised), whose row is inert."""
    alive = [index for index, episode in enumerate(episodes) if episode.failure is None]
    rewards, stats = [0.0] * len(episodes), {}
    if alive:
        values, stats = score([records[i] for i in alive], [episodes[i] for i in alive])
        for index, value in zip(alive, values, strict=True):
            rewards[index] = value if episodes[index].failure is None else 0.0
    return rewards, stats


def scored(episode: Episode) -> float:
    """The episode's reward by its environment: NaN where it gives none (the task's reward scores the episode), and 0.0
    for an episode that failed, or fails here (a reward that raises, runs past the episode's time or is not a finite
    number), whose row is inert: the task is not asked."""
    if episode.failure is None:
        try:
            reward = episode_reward(episode.environment, episode.where, episode.clock)
            if reward is not None:
                return checked_reward(reward, episode.environment.method_name("reward"), f"on {episode.where}")
            return float("nan")
        except EnvironmentFailure as error:
            episode.fail(error)
        except RewardError as error:
            episode.fail(EnvironmentFailure(str(error), "reward_wrong_type"))
    return 0.0


def take_turn(episode: Episode, generation: Generation, row: int, turn: int, last: bool, limits: EpisodeLimits,
              stops: set[int], tokenizer) -> None:
    """Appends row ``row`` of ``generation`` to ``episode`` as its turn ``turn``, then the environment's answer."""
    sampled = generation.completion_mask[row].bool()
    tokens = generation.input_ids[row, generation.prompt_length:][sampled].tolist()
    logprobs = None if generation.sampler_logprobs is None else generation.sampler_logprobs[row][sampled].tolist()
    if generation.sampler_steps is not None:
        episode.turn_steps.append(int(generation.sampler_steps[row]))
    room = limits.max_episode_tokens - len(episode.tokens)
    stopped = bool(tokens) and tokens[-1] in stops
    episode.turns += 1
    episode.append(tokens[:room], True, None if logprobs is None else logprobs[:room])
    episode.transcript.append(generation.texts[row])
    if len(tokens) > room:
        episode.ending = "episode_cut"
        return
    if not stopped:
        episode.ending = "turn_cut"
        return
    try:
        observation = step_episode(episode.environment, generation.texts[row], turn, episode.where, episode.clock)
    except EnvironmentFailure as error:
        episode.fail(error)
        return
    episode.tool_calls += observation.tool_calls
    episode.tool_errors += observation.tool_errors
    episode.tool_output_faults += observation.tool_output_faults
    if observation.done:
        episode.ending = "done"
        return
    if last:
        return
    # an observation that fills the episode leaves no room for another turn
    if episode.append_reply(observation.text, limits.max_episode_tokens, tokenizer):
        episode.ending = "episode_cut"


def as_generation(episodes: list[Episode], pad_id: int, device: torch.device, rewards: list[float], sync_seconds: float,
                  stats: dict[str, float]) -> Generation:
    """The episodes as rows of one :class:`Generation`."""
    prompt_ids, prompt_mask = padded([e.prompt for e in episodes], pad_id, left=True)
    tokens, attended = padded([e.tokens or [pad_id] for e in episodes], pad_id, left=False)
    attended *= torch.tensor([bool(e.tokens) for e in episodes]).unsqueeze(1)
    from_policy, _ = padded([e.from_policy or [False] for e in episodes], 0, left=False)
    sampler_logprobs = None
    if any(e.turn_steps or any(e.sampler_logprobs) for e in episodes):
        sampler_logprobs = padded_floats([e.sampler_logprobs for e in episodes], tokens.shape[1])
    # a row counts as sampled by the oldest weights any of its turns had
    steps = [min(e.turn_steps, default=None) for e in episodes]
    trained = torch.tensor([e.failure is None for e in episodes])
    return Generation(
        input_ids=torch.cat([prompt_ids, tokens], 1).to(device),
        attention_mask=torch.cat([prompt_mask, attended], 1).to(device),
        # a failed episode's row is inert: none of its tokens is the policy's to credit
        completion_mask=(from_policy.bool() & attended.bool() & trained.unsqueeze(1)).long().to(device),
        prompt_length=prompt_ids.shape[1],
        texts=["".join(e.transcript) for e in episodes],
        sampler_logprobs=None if sampler_logprobs is None else sampler_logprobs.to(device),
        sync_seconds=sync_seconds,
        sampler_steps=None if None in steps else torch.tensor(steps, device=device),
        stats=stats,
        rewards=torch.tensor(rewards, device=device),
        failures=[e.failure for e in episodes],
    )


def padded_floats(rows: list[list[float]], width: int) -> Tensor:
    values = torch.zeros(len(rows), width)
    for index, row in enumerate(rows):
        values[index, : len(row)] = torch.tensor(row, dtype=values.dtype)
    return values


def episode_stats(episodes: list[Episode]) -> dict[str, float]:
    """``rollout/...`` statistics of the episodes.

    ``turns`` per episode; ``tool_calls``, ``tool_errors`` and ``tool_output_faults`` per episode; ``env_token_share``, the environment's
    share of the tokens after the prompts; ``frac_turn_limit``, episodes that ran out of turns; ``frac_turn_cut``,
    turns cut at ``max_turn_tokens``; ``frac_episode_cut``, episodes cut at ``max_episode_tokens``;
    ``frac_truncated``, episodes cut by either token limit (as a single-turn completion cut at ``max_new_tokens``);
    where the engine reports each turn's weights (sampled ahead of the trainer), ``mixed_versions``, the episodes whose
    turns more than one weights version sampled.
    """
    count = len(episodes)
    endings = {ending: sum(e.ending == ending for e in episodes) / count for ending in ENDINGS}
    all_tokens = sum(len(e.tokens) for e in episodes)
    environment_tokens = sum(len(e.from_policy) - sum(e.from_policy) for e in episodes)
    turns = sum(e.turns for e in episodes)
    return {
        "rollout/turns": turns / count,
        "rollout/tool_calls": sum(e.tool_calls for e in episodes) / count,
        "rollout/tool_errors": sum(e.tool_errors for e in episodes) / count,
        "rollout/tool_output_faults": sum(e.tool_output_faults for e in episodes) / count,
        "rollout/env_token_share": environment_tokens / max(all_tokens, 1),
        "rollout/frac_turn_limit": endings["turn_limit"],
        "rollout/frac_turn_cut": sum(e.ending == "turn_cut" for e in episodes) / max(turns, 1),
        "rollout/frac_episode_cut": endings["episode_cut"],
        "rollout/frac_truncated": endings["turn_cut"] + endings["episode_cut"],
    } | ({"rollout/mixed_versions": sum(len(set(e.turn_steps)) > 1 for e in episodes) / count}
         if any(e.turn_steps for e in episodes) else {})

"""Agent tasks: a task whose rollouts are episodes against an environment, and one that adds an environment to any task.

The producer and validation call :meth:`Task.rollout`; an :class:`AgentTask` answers with whole episodes
(:func:`~lit_cancel.agents.episodes.run_episodes`), one environment each. An episode's reward is its environment's
(:meth:`Environment.reward`) where it gives one, else the task's ``reward(record, transcript)``, the transcript being the
episode's turns and observations as text.
"""

import random
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_cancel.agents.environment import Environment, EnvironmentFailure, factory_name, new_environment, reset_episode, step_episode
from lit_cancel.agents.episodes import Episode, EpisodeLimits, run_episodes
from lit_cancel.agents.tools import CallFormat
from lit_cancel.agents.trl_environment import TRLEnvironment, dataset_row, from_trl_factory, rendered
from lit_cancel.agents.trl_rewards import CALLED_AS, RewardFunctions
from lit_cancel.hub import load_tokenizer
from lit_cancel.rounds.draw import record_names
from lit_cancel.rounds.sample import Generation
from lit_cancel.rounds.score import RewardError
from lit_cancel.tasks import DatasetTask, Record, Task, WrappingTask

Demonstration = list[tuple[str, str]]


class AgentTask(Task):
    """A task whose rollouts are episodes of several turns against an environment.

    Args:
        max_turns: turns of the policy per episode at most.
        max_turn_tokens: tokens per turn at most; the policy module's ``max_new_tokens`` when None.
        max_episode_tokens: tokens after the prompt per episode at most, the policy's and the environment's.
        episode_timeout: seconds an episode's environment calls (factory, ``reset``, ``step``, ``reward``) may take in
            all; an episode past it fails, as one whose environment raises does (its row inert, the others trained:
            :mod:`lit_cancel.rounds.failures`). None: no limit.

    A subclass makes the records and one :meth:`environment` per episode, and scores episodes where the environment
    does not; :meth:`demonstration` (an episode that succeeds: :meth:`demonstration_turns` replayed against a new
    environment) is what a supervised warm-up trains on.
    """

    rollout_in_one_call = False  # the policy is asked once per turn, the environment answering between turns

    def __init__(self, max_turns: int = 4, max_turn_tokens: int | None = None, max_episode_tokens: int = 512,
                 episode_timeout: float | None = None) -> None:
        self.limits = EpisodeLimits(max_turns, max_turn_tokens, max_episode_tokens, episode_timeout)
        self.train_positions: dict[int, int] | None = None

    @abstractmethod
    def environment(self) -> Environment:
        """A new environment for one episode."""

    @property
    def environment_factory(self) -> Callable[[], Environment]:
        """What makes each episode's environment, as messages name it: :meth:`environment`."""
        return self.environment

    def check_environment(self) -> Environment:
        """One environment, built as an episode builds it, so that a factory that raises (a tool without a docstring, two
        tools of one name) or makes something else than an :class:`Environment` fails at start-up: returns it, or raises
        :class:`~lit_cancel.agents.EnvironmentFailure` naming the factory."""
        return new_environment(self.environment_factory, "at start-up")

    def check_startup(self) -> None:
        """:meth:`check_environment`, its failure as ValueError."""
        try:
            self.check_environment()
        except EnvironmentFailure as error:
            raise ValueError(str(error)) from error

    def demonstration_turns(self, record: Record, rng: random.Random) -> list[str]:
        """The policy's turns of one episode that succeeds on ``record``: the task's first solution as one turn here."""
        return [self.solutions(record)[0]]

    def demonstration(self, record: Record, rng: random.Random) -> Demonstration:
        """One episode that succeeds on ``record``, as ``(turn, observation)`` pairs, for supervised warm-up (each turn
        is trained and closed by EOS, observations are not): :meth:`demonstration_turns` replayed against a new
        environment (:func:`replayed`), so that each observation is the one the environment gives."""
        return replayed(self.environment_factory, record, self.demonstration_turns(record, rng), self.limits.max_turns,
                        self.demonstrated(record))

    def demonstrated(self, record: Record) -> str:
        """How messages name ``record``, a training record being demonstrated: ``"train record 3 ('train.jsonl' line
        4)"`` (:func:`~lit_cancel.rounds.draw.record_names`), or by its prompt where it is none of the task's."""
        if self.train_positions is None:
            self.train_positions = {id(train_record): index for index, train_record in enumerate(self.train_records())}
        index = self.train_positions.get(id(record))
        if index is not None:
            return record_names(self, "train", [index])[0]
        prompt = str(record["prompt"])
        return f"the record with the prompt {prompt if len(prompt) <= 60 else prompt[:57] + '...'!r}"

    def new_tokens_limit(self, max_new_tokens: int | None) -> tuple[int | None, str, str]:
        return self.limits.max_episode_tokens, "max_episode_tokens", "the task's max_episode_tokens"

    def drift_probes(self, count: int) -> list[dict]:
        """ValueError: an agent task's solutions are episodes with the environment's replies in them."""
        raise ValueError(
            f"SolutionProbabilityDriftMonitor scores each solution as one completion, but {type(self).__name__}'s "
            "are episodes whose environment replies it would score too: leave the monitor out of an agent run, or give "
            "it probes=[...] of your own"
        )

    def rollout(self, policy, records: list[Record], input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1,
                greedy: bool = False, names: Sequence[str] | None = None) -> Generation:
        return run_episodes(policy, self.environment_factory, self.limits, records, input_ids, attention_mask, num_samples,
                            greedy, names)


class EnvironmentTask(AgentTask, WrappingTask):
    """Any task's records and reward, with episodes against an environment: how a TRL environment or your own runs.

    Args:
        task: where records come from; its ``reward(record, transcript)`` and ``correct`` score episodes that no reward
            function or environment scores (a :class:`~lit_cancel.DatasetTask` reads a TRL dataset as it is).
        environment: a callable that makes one :class:`Environment` per episode (a class, or a function returning one;
            one named in a config needs the return type hint ``-> Environment``).
        trl_environment: instead, a TRL ``environment_factory``: a callable returning one object per episode whose
            public methods are the tools, whose ``reset(**row)`` may return text, and whose optional
            ``get_reward()`` scores the episode (:class:`~lit_cancel.agents.TRLEnvironment`).
        reward_funcs: TRL's reward functions (callables, or their import paths), each called on a draw's finished
            episodes as TRL calls it, with ``environments=`` the episodes' environments
            (:mod:`~lit_cancel.agents.trl_rewards` says what each argument holds); an episode's reward is their weighted
            sum plus the environment's own reward (weight 1), values of None left out, and the task's reward where
            all are None. None: the environment's reward, else the task's.
        reward_weights: one weight per reward function (TRL's ``reward_weights``); 1.0 each when None.
        max_turns, max_turn_tokens, max_episode_tokens, episode_timeout: as :class:`AgentTask`.
        tool_timeout: seconds a tool call of a TRL environment may take; 10 when None. An environment of your own times
            its tools itself.
        chat_template: a local Hugging Face folder (``embedded:NAME`` too) whose tokenizer's chat template renders each
            record's prompt (text as one user message, or a list of chat messages as it is: TRL's conversational
            format) with the environment's tool schemas (``tools=``) and the assistant's generation prompt, as an
            instruct model expects them; None: prompts as the task gives them (a prompt of chat messages is then refused
            at start-up). The folder is read when records are first asked for (at start-up), so a recipe builds where
            it is absent.
        call_format: how the tool calls of a TRL environment are written in the policy's turns and its results shown
            (:class:`~lit_cancel.agents.HermesCalls`, Qwen2.5's, when None; :class:`~lit_cancel.agents.ColonCalls` for the
            embedded agent): what TRL reads from the tokenizer's chat template. An ``environment`` of your own parses its
            turns itself.
        demonstration_turns: ``(record) -> list of texts``, the policy's turns of an episode that succeeds on a record (a
            scripted policy), replayed against a new environment to make the demonstrations a supervised warm-up trains
            on (:meth:`demonstration`); None: the task's first solution as one turn.

    Example (YAML)::

        task:
          class_path: lit_cancel.agents.EnvironmentTask
          init_args:
            task: {class_path: lit_cancel.DatasetTask, init_args: {train_file: data/train.jsonl, val_file: data/test.jsonl}}
            trl_environment: my_package.CalculatorEnv
            reward_funcs: [my_package.correct_answer]
            max_turns: 4
    """

    # trl_environment takes a type too: jsonargparse reads a class path as a Callable only where the class is the return
    # type's or its instances are callable, and a TRL environment is neither
    def __init__(self, task: Task, environment: Callable[[], Environment] | None = None,
                 trl_environment: type | Callable[[], object] | None = None, reward_funcs: list[Callable | str] | None = None,
                 reward_weights: list[float] | None = None, max_turns: int = 4, max_turn_tokens: int | None = None,
                 max_episode_tokens: int = 512, tool_timeout: float | None = None, chat_template: str | None = None,
                 call_format: CallFormat | None = None,
                 demonstration_turns: Callable[[Record], list[str]] | None = None, episode_timeout: float | None = None) -> None:
        super().__init__(max_turns, max_turn_tokens, max_episode_tokens, episode_timeout)
        if (environment is None) == (trl_environment is None):
            raise ValueError("EnvironmentTask: give exactly one of environment (an Environment factory) and trl_environment "
                             "(a TRL environment_factory)")
        if call_format is not None and trl_environment is None:
            raise ValueError("EnvironmentTask: call_format applies to a trl_environment; an environment of your own parses "
                             "its turns in its step")
        if tool_timeout is not None and trl_environment is None:
            raise ValueError("EnvironmentTask: tool_timeout applies to a trl_environment; an environment of your own times its tools")
        if call_format is not None and not isinstance(call_format, CallFormat):
            raise ValueError(f"EnvironmentTask: call_format must be a CallFormat (e.g. lit_cancel.agents.ColonCalls), got "
                             f"{call_format!r}")
        for name, value in (("environment", environment), ("trl_environment", trl_environment),
                            ("demonstration_turns", demonstration_turns)):
            if value is not None and not callable(value):
                raise ValueError(f"EnvironmentTask: {name} must be a class or a function, got {value!r}")
        if reward_weights is not None and not reward_funcs:
            raise ValueError("EnvironmentTask: reward_weights weigh reward_funcs, and none are given")
        if callable(reward_funcs) or isinstance(reward_funcs, str):
            reward_funcs = [reward_funcs]  # TRL takes one function as well as a list
        self.task = task
        self.make = (environment if environment is not None else
                     from_trl_factory(trl_environment, calls=call_format, timeout=10.0 if tool_timeout is None else tool_timeout))
        self.reward_functions = RewardFunctions(reward_funcs, reward_weights) if reward_funcs else None
        self.chat_template = chat_template
        self.turns = demonstration_turns
        self.rendered: dict[str, list[Record]] = {}

    def environment(self) -> Environment:
        return self.make()

    @property
    def environment_factory(self) -> Callable[[], Environment]:
        return self.make

    def train_records(self) -> list[Record]:
        return self.task.train_records() if self.chat_template is None else self.chat_records()["train"]

    def val_records(self) -> list[Record]:
        return self.task.val_records() if self.chat_template is None else self.chat_records()["val"]

    def chat_records(self) -> dict[str, list[Record]]:
        """Both splits' records with their prompts rendered by :attr:`chat_template`, once: each a new dict whose other
        fields are the task's, so that its reward and correctness read them unchanged, with the prompt as the task gave
        it in one more field (:func:`~lit_cancel.agents.trl_environment.rendered`), which a TRL environment's ``reset``
        and TRL's reward functions get instead."""
        if not self.rendered:
            tokenizer = chat_tokenizer(self.chat_template)
            tools = getattr(self.check_environment(), "schemas", None) or None
            self.rendered = {split: [rendered(record, chat_prompt(tokenizer, record["prompt"], tools)) for record in records]
                             for split, records in (("train", self.task.train_records()), ("val", self.task.val_records()))}
        return self.rendered

    def rollout(self, policy, records: list[Record], input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1,
                greedy: bool = False, names: Sequence[str] | None = None) -> Generation:
        return run_episodes(policy, self.environment_factory, self.limits, records, input_ids, attention_mask, num_samples,
                            greedy, names, score=self.reward_functions)

    def check_startup(self) -> None:
        """Refuses at start-up, in one line: an environment factory that fails (:meth:`check_environment`); a prompt of
        chat messages without a ``chat_template``; a :class:`~lit_cancel.DatasetTask` without a reward that nothing else
        scores; reward functions that raise or return something else than one number or None per completion, called
        once on the first training record, an environment reset on it and an empty completion; ``demonstration_turns``
        that cannot be replayed on that record."""
        try:
            environment = self.check_environment()
        except EnvironmentFailure as error:
            raise ValueError(str(error)) from error
        if self.chat_template is None:
            for split, records in (("train", self.task.train_records()), ("val", self.task.val_records())):
                if listed := [index for index, record in enumerate(records) if isinstance(record["prompt"], list)]:
                    raise ValueError(f"EnvironmentTask: the prompt of {record_names(self.task, split, listed[:1])[0]} is a "
                                     "list of chat messages; set chat_template to a folder whose tokenizer has a chat template "
                                     "(an instruct model's) to render them, as TRL renders a conversational prompt")
        if isinstance(self.task, DatasetTask) and self.task.reward_fn is None and self.reward_functions is None:
            scores = (callable(getattr(environment.instance, "get_reward", None)) if isinstance(environment, TRLEnvironment)
                      else type(environment).reward is not Environment.reward)
            if not scores:
                raise ValueError(f"EnvironmentTask: nothing scores the episodes: DatasetTask has no reward of its own, "
                                 f"reward_funcs is empty and {environment.method_name('reward')} is not defined; give "
                                 "reward_funcs (TRL's reward functions) or an environment with a reward, as TRL requires one")
        records = self.train_records()[:1]
        if not records:
            return
        where = record_names(self.task, "train", [0])[0]
        try:
            if self.reward_functions is not None:
                episode = Episode([], environment, where, transcript=[""])
                reset_episode(environment, records[0], where)
                for index in range(len(self.reward_functions.functions)):
                    self.reward_functions.called(index, [dataset_row(records[0])], [episode], [where], lambda name, value: None)
            if self.turns is not None:
                self.demonstration(records[0], random.Random(0))
        except RewardError as error:
            raise ValueError(f"{error} (checked at start-up: {CALLED_AS})") from error
        except EnvironmentFailure as error:
            raise ValueError(str(error)) from error

    def demonstration_turns(self, record: Record, rng: random.Random) -> list[str]:
        """``demonstration_turns(record)`` where given (its turns checked to be texts), else the task's first solution
        as one turn."""
        if self.turns is None:
            return super().demonstration_turns(record, rng)
        name = factory_name(self.turns)
        try:
            turns = self.turns(record)
        except Exception as error:
            raise EnvironmentFailure(f"demonstration_turns {name} raised on {self.demonstrated(record)}: "
                                     f"{type(error).__name__}: {error}") from error
        if not isinstance(turns, list | tuple) or not turns or not all(isinstance(turn, str) for turn in turns):
            raise EnvironmentFailure(f"demonstration_turns {name} returned {turns!r} on {self.demonstrated(record)}; it must return "
                                     "the policy's turns, a non-empty list of texts")
        return list(turns)


def replayed(make_environment: Callable[[], Environment], record: Record, turns: list[str], max_turns: int,
             where: str) -> Demonstration:
    """``turns`` as an episode on ``record`` (named ``where`` in messages): a new environment reset on it, then each
    turn's ``step``, as ``(turn, observation)`` pairs holding the environment's own observations (none after the turn
    that ends the episode or the ``max_turns``-th), first ``("", text)`` where ``reset`` adds text to the prompt.
    EnvironmentFailure where the environment fails or the episode ends before the last turn."""
    environment = new_environment(make_environment, f"for {where}")
    opening = reset_episode(environment, record, where)
    pairs = [("", opening)] if opening else []
    for number, turn in enumerate(turns, start=1):
        observation = step_episode(environment, turn, number, where)
        ended = observation.done or number == max_turns
        if ended and number < len(turns):
            reason = "the environment ended it" if observation.done else f"max_turns is {max_turns}"
            raise EnvironmentFailure(f"the demonstration of {where} has {len(turns)} turns, but its episode ends at turn "
                                     f"{number} ({turn!r}): {reason}")
        pairs.append((turn, "" if ended else observation.text))
    return pairs


def chat_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``path``; ValueError naming the ``chat_template`` option where it has no chat template."""
    tokenizer = load_tokenizer(path, option="chat_template")
    if not tokenizer.chat_template:
        raise ValueError(f"EnvironmentTask: chat_template={path!r} names a tokenizer without a chat template; name the folder "
                         "of an instruct model (e.g. Qwen2.5-0.5B-Instruct), or set chat_template: null for the task's prompts")
    return tokenizer


def chat_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], tools: list[dict] | None) -> str:
    """``prompt`` (text, as the one user message; or chat messages) as a chat with ``tools``, up to the assistant's
    turn, as text."""
    messages: list[dict[str, Any]] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

"""Agent tasks: a task whose rollouts are episodes against an environment, and one that adds an environment to any task.

The producer and validation call :meth:`Task.rollout`; an :class:`AgentTask` answers with whole episodes
(:func:`~lit_cancel.agents.episodes.run_episodes`), one environment each. An episode's reward is its environment's
(:meth:`Environment.reward`) where it gives one, else the task's ``reward(record, transcript)``, the transcript being the
episode's turns and observations as text.
"""

import random
from abc import abstractmethod
from collections.abc import Callable, Sequence

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_cancel.agents.environment import Environment, EnvironmentFailure, new_environment
from lit_cancel.agents.episodes import EpisodeLimits, run_episodes
from lit_cancel.agents.tools import CallFormat
from lit_cancel.agents.trl_environment import from_trl_factory
from lit_cancel.hub import load_tokenizer
from lit_cancel.rounds.sample import Generation
from lit_cancel.tasks import Record, Task

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
    does not; :meth:`demonstrations` (episodes that succeed) are what a supervised warm-up trains on.
    """

    rollout_in_one_call = False  # the policy is asked once per turn, the environment answering between turns

    def __init__(self, max_turns: int = 4, max_turn_tokens: int | None = None, max_episode_tokens: int = 512,
                 episode_timeout: float | None = None) -> None:
        self.limits = EpisodeLimits(max_turns, max_turn_tokens, max_episode_tokens, episode_timeout)

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

    def demonstration(self, record: Record, rng: random.Random) -> Demonstration:
        """One episode that succeeds on ``record``, as ``(turn, observation)`` pairs, for supervised warm-up (each turn
        is trained and closed by EOS, observations are not); the task's first solution as one turn by default."""
        return [(self.solutions(record)[0], "")]

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


class EnvironmentTask(AgentTask):
    """Any task's records and reward, with episodes against an environment: how a TRL environment or your own runs.

    Args:
        task: where records come from; its ``reward(record, transcript)`` and ``correct`` score episodes whose
            environment gives no reward.
        environment: a callable that makes one :class:`Environment` per episode (a class, or a function returning one;
            one named in a config needs the return type hint ``-> Environment``).
        trl_environment: instead, a TRL ``environment_factory``: a callable returning one object per episode whose
            public methods are the tools, whose ``reset(**record)`` may return text, and whose optional
            ``get_reward()`` scores the episode (:class:`~lit_cancel.agents.TRLEnvironment`).
        max_turns, max_turn_tokens, max_episode_tokens, episode_timeout: as :class:`AgentTask`.
        tool_timeout: seconds a tool call of a TRL environment may take; 10 when None. An environment of your own times
            its tools itself.
        chat_template: a local Hugging Face folder (``embedded:NAME`` too) whose tokenizer's chat template renders each
            record's prompt as one user message, with the environment's tool schemas (``tools=``) and the assistant's
            generation prompt, as an instruct model expects them; None: prompts as the task gives them. The folder is
            read when records are first asked for (at start-up), so a recipe builds where it is absent.
        call_format: how the tool calls of a TRL environment are written in the policy's turns and its results shown
            (:class:`~lit_cancel.agents.HermesCalls`, Qwen2.5's, when None; :class:`~lit_cancel.agents.ColonCalls` for the
            embedded agent): what TRL reads from the tokenizer's chat template. An ``environment`` of your own parses its
            turns itself.

    Example (YAML)::

        task:
          class_path: lit_cancel.agents.EnvironmentTask
          init_args:
            task: {class_path: lit_cancel.MathWordTask, init_args: {train_file: data/train.jsonl, val_file: data/test.jsonl}}
            trl_environment: my_package.CalculatorEnv
            max_turns: 4
    """

    # trl_environment takes a type too: jsonargparse reads a class path as a Callable only where the class is the return
    # type's or its instances are callable, and a TRL environment is neither
    def __init__(self, task: Task, environment: Callable[[], Environment] | None = None,
                 trl_environment: type | Callable[[], object] | None = None, max_turns: int = 4, max_turn_tokens: int | None = None,
                 max_episode_tokens: int = 512, tool_timeout: float | None = None, chat_template: str | None = None,
                 call_format: CallFormat | None = None, episode_timeout: float | None = None) -> None:
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
        for name, value in (("environment", environment), ("trl_environment", trl_environment)):
            if value is not None and not callable(value):
                raise ValueError(f"EnvironmentTask: {name} must be a class or a function that makes one per episode, got "
                                 f"{value!r}")
        self.task = task
        self.make = (environment if environment is not None else
                     from_trl_factory(trl_environment, calls=call_format, timeout=10.0 if tool_timeout is None else tool_timeout))
        self.chat_template = chat_template
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
        fields are the task's, so that its reward and correctness read them unchanged."""
        if not self.rendered:
            tokenizer = chat_tokenizer(self.chat_template)
            tools = getattr(self.check_environment(), "schemas", None) or None
            self.rendered = {split: [{**record, "prompt": chat_prompt(tokenizer, record["prompt"], tools)} for record in records]
                             for split, records in (("train", self.task.train_records()), ("val", self.task.val_records()))}
        return self.rendered

    def reward(self, record: Record, completion: str) -> float:
        return self.task.reward(record, completion)

    def correct(self, record: Record, completion: str) -> bool | None:
        return self.task.correct(record, completion)

    def solutions(self, record: Record) -> list[str]:
        return self.task.solutions(record)

    def record_source(self, split: str, index: int) -> str:
        return self.task.record_source(split, index)


def chat_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``path``; ValueError naming the ``chat_template`` option where it has no chat template."""
    tokenizer = load_tokenizer(path, option="chat_template")
    if not tokenizer.chat_template:
        raise ValueError(f"EnvironmentTask: chat_template={path!r} names a tokenizer without a chat template; name the folder "
                         "of an instruct model (e.g. Qwen2.5-0.5B-Instruct), or set chat_template: null for the task's prompts")
    return tokenizer


def chat_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, tools: list[dict] | None) -> str:
    """``prompt`` as the one user message of a chat with ``tools``, up to the assistant's turn, as text."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=tools, add_generation_prompt=True,
                                         tokenize=False)

"""A task whose episodes an agent program runs through the run's OpenAI-compatible endpoint
(:mod:`~lit_cancel.agents.programs`)."""

from collections.abc import Sequence

from torch import Tensor

from lit_cancel.agents.endpoint import ChatEndpoint
from lit_cancel.agents.episodes import EpisodeLimits
from lit_cancel.agents.programs import Program, ProgramLoop, checked_program, first_requests, run_programs
from lit_cancel.agents.task import chat_tokenizer
from lit_cancel.agents.tools import CallFormat, HermesCalls
from lit_cancel.agents.trl_environment import rendered
from lit_cancel.rounds.draw import record_names
from lit_cancel.rounds.sample import Generation
from lit_cancel.tasks import Record, Task, WrappingTask


class ProgramTask(WrappingTask):
    """Any task's records, each episode run by an agent program that calls an OpenAI-style chat API.

    Args:
        task: where records come from; its ``reward(record, transcript)`` scores an episode whose program returns None,
            its ``correct`` is ``val/accuracy``'s (the transcript: the policy's turns and what followed each, as text).
        program: ``async def run(client, record) -> float | None``, or its import path (``my_agent.run``, its folder on
            ``PYTHONPATH``): ``client`` is an ``openai.AsyncOpenAI`` of the episode's session, ``record`` the task's row.
        chat_template: a local Hugging Face folder (``embedded:NAME`` too) whose tokenizer's chat template renders the
            program's requests (messages and ``tools``); its vocabulary must be the policy's (the instruct model's folder).
        call_format: how tool calls are written in the policy's turns, returned to the program as OpenAI ``tool_calls``
            (:class:`~lit_cancel.agents.HermesCalls`, Qwen2.5's, when None).
        max_turns: requests sampled per episode at most; later ones get an empty completion cut for ``length``.
        max_turn_tokens: tokens per turn at most (a request's ``max_tokens`` may ask fewer); the policy module's
            ``max_new_tokens`` when None.
        max_episode_tokens: tokens after the prompt per episode at most, the policy's and the rest of the conversation's.
        episode_timeout: seconds a program may spend outside the endpoint in all (its tools, its own code); one past it
            fails its episode and is cancelled.
        host: where the endpoint listens; 127.0.0.1 keeps it on this machine.
        max_request_bytes: largest request a program may send (413 beyond).

    Example (YAML)::

        task:
          class_path: lit_cancel.agents.ProgramTask
          init_args:
            task: {class_path: lit_cancel.agents.ToolAdditionTask, init_args: {num_digits: 5}}
            program: calculator_agent.run
            chat_template: embedded:tiny-agent
            call_format: lit_cancel.agents.ColonCalls
    """

    rollout_in_one_call = False  # the policy is asked once per turn, the programs answering between turns

    def __init__(self, task: Task, program: Program | str, chat_template: str, call_format: CallFormat | None = None,
                 max_turns: int = 4, max_turn_tokens: int | None = None, max_episode_tokens: int = 512,
                 episode_timeout: float | None = 600.0, host: str = "127.0.0.1", max_request_bytes: int = 1 << 20) -> None:
        if call_format is not None and not isinstance(call_format, CallFormat):
            raise ValueError(f"ProgramTask: call_format must be a CallFormat (e.g. lit_cancel.agents.ColonCalls), got {call_format!r}")
        if max_request_bytes < 1:
            raise ValueError(f"ProgramTask: max_request_bytes must be >= 1, got {max_request_bytes}")
        self.task, self.program, self.chat_template = task, checked_program(program), chat_template
        self.calls = call_format or HermesCalls()
        self.limits = EpisodeLimits(max_turns, max_turn_tokens, max_episode_tokens, episode_timeout)
        self.host, self.max_request_bytes = host, max_request_bytes
        self.endpoint: ChatEndpoint | None = None
        self.loop: ProgramLoop | None = None
        self.template = None
        self.prompted: dict[str, list[Record]] = {}

    def serve(self) -> None:
        """Starts the endpoint and the programs' event loop, once per process."""
        if self.endpoint is None:
            self.template = chat_tokenizer(self.chat_template)
            self.loop = ProgramLoop()
            self.endpoint = ChatEndpoint("policy", self.host, 0, self.max_request_bytes)

    def prompted_records(self) -> dict[str, list[Record]]:
        """Both splits' records, each a new dict with the task's fields and, as its prompt, its program's first request
        rendered by the chat template (read once, at start-up); the program is given each record as the task made it."""
        if not self.prompted:
            self.serve()
            timeout = self.limits.episode_timeout or 600.0
            for split, records in (("train", self.task.train_records()), ("val", self.task.val_records())):
                names = record_names(self.task, split, range(len(records)))
                prompts = first_requests(self.program, self.endpoint, self.loop, self.template, records, names, timeout)
                self.prompted[split] = [rendered(record, prompt) for record, prompt in zip(records, prompts, strict=True)]
        return self.prompted

    def train_records(self) -> list[Record]:
        return self.prompted_records()["train"]

    def val_records(self) -> list[Record]:
        return self.prompted_records()["val"]

    def check_startup(self) -> None:
        """Refuses at start-up, in one line: a ``chat_template`` without a chat template; a program that raises, ends or
        hangs before its first request on some record."""
        self.prompted_records()

    def rollout(self, policy, records: list[Record], input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1,
                greedy: bool = False, names: Sequence[str] | None = None) -> Generation:
        self.serve()
        return run_programs(policy, self.program, self.endpoint, self.loop, self.template, self.calls, self.limits, records,
                            input_ids, attention_mask, num_samples, greedy, names)

    def new_tokens_limit(self, max_new_tokens: int | None) -> tuple[int | None, str, str]:
        return self.limits.max_episode_tokens, "max_episode_tokens", "the task's max_episode_tokens"

    def drift_probes(self, count: int) -> list[dict]:
        """ValueError: a program's solutions are episodes, with what the program added to them."""
        raise ValueError("SolutionProbabilityDriftMonitor scores each solution as one completion, but a ProgramTask's are "
                         "episodes: leave the monitor out of an agent run, or give it probes=[...] of your own")

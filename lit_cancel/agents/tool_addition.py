"""The embedded agent task: add two long numbers, with a calculator tool the policy may call first.

Why this task: a tiny model cannot add two 5-digit numbers in its head, but it can copy them into a call of the
``calculate`` tool and copy the tool's answer back, so success needs the environment's feedback; the warm-start policy
calls the tool only sometimes, so RL has a clear choice to learn (call, or answer at once); and every episode of a
group that calls the tool writes the same call and reads the same answer, so a group's episodes share whole turns,
the case the learning tax of an agent measures. An episode::

    12345+67890=calculate: 12345+67890 = 80235
    80235

(``12345+67890=`` is the prompt; the policy wrote the call and then the answer, each closed by its stop token; the
environment wrote `` = 80235`` and a newline.) A turn without a colon is the answer and ends the episode.
"""

import random

from lit_cancel.agents.calculator import calculate
from lit_cancel.agents.task import AgentTask, Demonstration
from lit_cancel.agents.tools import ColonCalls, ToolEnvironment
from lit_cancel.tasks import AdditionTask, Record


class ToolAdditionTask(AgentTask):
    """``a+b=`` with ``num_digits``-digit operands, answered in at most ``max_turns`` turns with the ``calculate`` tool.

    Records are :class:`~lit_cancel.AdditionTask`'s (``{"prompt": "12345+67890=", "a": 12345, "b": 67890, "answer":
    "80235"}``); the reward is 1.0 when the episode's last turn is the sum, else 0.0.

    Args:
        num_digits: digits per operand.
        train_size: training problems.
        val_size: held-out problems, disjoint from the training ones.
        max_turns: turns per episode (a call and the answer take two).
        tool_share: the share of demonstrations (:meth:`demonstration`, what a supervised warm-up trains on) that call
            the tool; the others answer at once.
        seed: seed of both splits.
        episode_timeout: as :class:`AgentTask`.
    """

    def __init__(self, num_digits: int = 5, train_size: int = 20000, val_size: int = 200, max_turns: int = 3,
                 tool_share: float = 0.5, seed: int = 0, episode_timeout: float | None = None) -> None:
        call_tokens = len("calculate: ") + 2 * num_digits + 2
        super().__init__(max_turns=max_turns, max_turn_tokens=call_tokens, max_episode_tokens=max_turns * 2 * call_tokens,
                         episode_timeout=episode_timeout)
        if not 0 <= tool_share <= 1:
            raise ValueError(f"ToolAdditionTask: tool_share must be in [0, 1], got {tool_share}")
        self.problems, self.tool_share = AdditionTask(num_digits, train_size, val_size, seed), tool_share

    def environment(self) -> ToolEnvironment:
        return ToolEnvironment([calculate], calls=ColonCalls(), timeout=5.0, max_output_chars=64)

    def train_records(self) -> list[Record]:
        return self.problems.train_records()

    def val_records(self) -> list[Record]:
        return self.problems.val_records()

    def reward(self, record: Record, completion: str) -> float:
        return float(self.correct(record, completion))

    def correct(self, record: Record, completion: str) -> bool:
        """Whether the transcript's last line (the answer turn) is the sum."""
        return completion.rsplit("\n", 1)[-1].strip() == record["answer"]

    def solutions(self, record: Record) -> list[str]:
        """The transcript that calls the tool, then the one that answers at once."""
        return ["".join(turn + answer for turn, answer in episode) for episode in (self.calling(record), self.answering(record))]

    def calling(self, record: Record) -> Demonstration:
        call = record["prompt"].rstrip("=")
        return [(f"calculate: {call}", f" = {calculate(call)}\n"), (record["answer"], "")]

    def answering(self, record: Record) -> Demonstration:
        return [(record["answer"], "")]

    def demonstration(self, record: Record, rng: random.Random) -> Demonstration:
        """With probability ``tool_share`` the episode that calls the tool, else the one that answers at once: trained on
        both, a policy calls the tool only sometimes, and answering at once mostly fails for a tiny model."""
        return self.calling(record) if rng.random() < self.tool_share else self.answering(record)

"""Agents: episodes of several turns against an environment, with tools.

* :mod:`~lit_cancel.agents.environment`: :class:`Environment` (reset from a record, one :class:`Observation` a turn,
  optionally the episode's reward) and the checked calls a run makes of it.
* :mod:`~lit_cancel.agents.tools`: tools as Python functions with docstrings, :class:`ToolEnvironment`, the call
  formats (:class:`HermesCalls`) and how every fault of a tool becomes an observation.
* :mod:`~lit_cancel.agents.trl_environment`: environments written for TRL's ``environment_factory``.
* :mod:`~lit_cancel.agents.episodes`: episodes run turn by turn as one token sequence, with their limits.
* :mod:`~lit_cancel.agents.task`: :class:`AgentTask` (rollouts are episodes) and :class:`EnvironmentTask` (any task's
  records with an environment, a TRL one included).
* :mod:`~lit_cancel.agents.programs`, :mod:`~lit_cancel.agents.endpoint`, :mod:`~lit_cancel.agents.sessions`: agent
  programs that call an OpenAI-style API, trained through the run's endpoint (:class:`ProgramTask`).
* :mod:`~lit_cancel.agents.tool_addition`: the embedded agent task, :class:`ToolAdditionTask` (long addition with a
  calculator tool).
* :mod:`~lit_cancel.agents.calculator`: :func:`calculate`, safe arithmetic as a tool, and :class:`CalculatorEnvironment`,
  for word problems.
"""

from lit_cancel.agents.calculator import CalculatorEnvironment, calculate
from lit_cancel.agents.environment import Environment, EnvironmentFailure, Observation
from lit_cancel.agents.episodes import EpisodeLimits, run_episodes
from lit_cancel.agents.program_task import ProgramTask
from lit_cancel.agents.task import AgentTask, EnvironmentTask
from lit_cancel.agents.tool_addition import ToolAdditionTask
from lit_cancel.agents.tools import CallFormat, ColonCalls, HermesCalls, MalformedCall, ToolCall, ToolEnvironment, ToolResult
from lit_cancel.agents.trl_environment import TRLEnvironment, from_trl_factory

__all__ = [
    "AgentTask", "EnvironmentTask", "EpisodeLimits", "ProgramTask", "ToolAdditionTask", "run_episodes",
    "CalculatorEnvironment", "calculate",
    "CallFormat", "ColonCalls", "Environment", "EnvironmentFailure", "HermesCalls", "MalformedCall", "Observation", "TRLEnvironment",
    "ToolCall", "ToolEnvironment", "ToolResult", "from_trl_factory",
]

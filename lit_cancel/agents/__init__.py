"""Agents: episodes of several turns against an environment, with tools.

* :mod:`~lit_cancel.agents.environment`: :class:`Environment` (reset from a record, one :class:`Observation` a turn,
  optionally the episode's reward) and the checked calls a run makes of it.
* :mod:`~lit_cancel.agents.tools`: tools as Python functions with docstrings, :class:`ToolEnvironment`, the call
  formats (:class:`HermesCalls`) and how every fault of a tool becomes an observation.
* :mod:`~lit_cancel.agents.trl_environment`: environments written for TRL's ``environment_factory``.
"""

from lit_cancel.agents.environment import Environment, EnvironmentFailure, Observation
from lit_cancel.agents.tools import CallFormat, HermesCalls, MalformedCall, ToolCall, ToolEnvironment, ToolResult
from lit_cancel.agents.trl_environment import TRLEnvironment, from_trl_factory

__all__ = [
    "CallFormat", "Environment", "EnvironmentFailure", "HermesCalls", "MalformedCall", "Observation", "TRLEnvironment",
    "ToolCall", "ToolEnvironment", "ToolResult", "from_trl_factory",
]

"""Tools: plain Python functions with docstrings, called by the policy in its turns and answered in the next observation.

A tool's schema comes from its signature and docstring (``transformers.utils.get_json_schema``, as TRL and chat
templates read them), so a tool without a docstring that describes each argument is refused when the environment is
built. A :class:`CallFormat` finds the calls in a turn's text and renders their results; :class:`HermesCalls` is the
``<tool_call>`` JSON format of Qwen2.5's chat template.

Every fault of a tool is an observation the policy reads and never stops the run. A call that fails is answered with
the error and counted in ``tool_errors``: a tool that raises (its exception's type and message), one that does not
answer within ``timeout`` seconds (it is left running in a daemon thread and its late result dropped), a malformed call,
a call to no tool. An output that the policy reads repaired is counted in ``tool_output_faults``: one longer than
``max_output_chars`` (cut, and said so) or that is not UTF-8 (decoded with replacement characters). Control characters
other than newline and tab are dropped from every output.
"""

import json
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.utils import get_json_schema

from lit_cancel.agents.environment import Environment, Observation
from lit_cancel.tasks import Record


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote: the tool's name and its arguments by name."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the text the policy reads, whether the call failed (the text is its error), and whether its
    output reached the policy repaired (cut at ``max_output_chars``, or not UTF-8)."""

    name: str
    text: str
    failed: bool = False
    faulty_output: bool = False


class MalformedCall(ValueError):
    """A turn's text holds a tool call that cannot be read; the message says what is wrong, for the policy to read."""


class CallFormat(ABC):
    """How tool calls are written in a turn and how their results are shown to the policy."""

    @abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """The calls in a turn's ``text``, in order; none where the turn calls no tool (it answers). Raises
        :class:`MalformedCall` where a call cannot be read."""

    @abstractmethod
    def render(self, results: list[ToolResult]) -> str:
        """The observation that shows ``results`` to the policy."""

    def prose(self, text: str) -> str:
        """What a turn that calls tools says besides its calls (an OpenAI reply's ``content``); nothing here, where a turn
        with a call is the call."""
        return ""

    def for_tools(self, schemas: list[dict]) -> "CallFormat":
        """This format for an environment whose tools have ``schemas`` (what :class:`ToolEnvironment` uses); itself
        where the calls name their arguments."""
        return self


class HermesCalls(CallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, answered by ``<tool_response>`` blocks between
    ``prefix`` and ``suffix``; the defaults are Qwen2.5's chat template, whose turns end at ``<|im_end|>``.

    Args:
        prefix: what opens the observation, after the policy's turn and its stop token.
        suffix: what closes it, up to where the policy's next turn starts.
    """

    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, prefix: str = "\n<|im_start|>user", suffix: str = "<|im_end|>\n<|im_start|>assistant\n"):
        self.prefix, self.suffix = prefix, suffix

    def parse(self, text: str) -> list[ToolCall]:
        if text.count("<tool_call>") != len(self.CALL.findall(text)):
            raise MalformedCall("a <tool_call> is not closed by </tool_call>")
        calls = []
        for body in self.CALL.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError as error:
                raise MalformedCall(f"a tool call is not JSON: {error.msg} at character {error.pos}") from None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise MalformedCall('a tool call must be a JSON object with a "name"')
            arguments = call.get("arguments", {})
            if not isinstance(arguments, dict):
                raise MalformedCall(f'the "arguments" of {call["name"]} must be a JSON object')
            calls.append(ToolCall(call["name"], arguments))
        return calls

    def prose(self, text: str) -> str:
        return self.CALL.sub("", text).strip()

    def render(self, results: list[ToolResult]) -> str:
        blocks = "".join(f"\n<tool_response>\n{result.text}\n</tool_response>" for result in results)
        return f"{self.prefix}{blocks}{self.suffix}"


class ColonCalls(CallFormat):
    """One call per turn, written ``name: argument`` and answered `` = result`` on the same line: a format short enough
    for a small model to learn from scratch (the embedded agent's). A turn without a colon calls no tool.

    The text after the colon fills one parameter of the tool called: in an environment (:meth:`for_tools`), a tool's
    parameter named ``argument`` where it has one, else its first required parameter, whatever its name; unbound, or
    for a name that is no tool, ``argument``.

    Args:
        argument: the parameter the text after the colon fills where a tool has one of that name.
    """

    NAME = re.compile(r"[A-Za-z_]\w*")

    def __init__(self, argument: str = "expression"):
        self.argument = argument
        self.parameters: dict[str, str] = {}

    def for_tools(self, schemas: list[dict]) -> "ColonCalls":
        bound = ColonCalls(self.argument)
        for schema in schemas:
            parameters = schema["function"]["parameters"]
            names = list(parameters.get("properties", {}))
            required = [name for name in names if name in parameters.get("required", [])]
            if self.argument not in names and (required or names):
                bound.parameters[schema["function"]["name"]] = (required or names)[0]
        return bound

    def parse(self, text: str) -> list[ToolCall]:
        if ":" not in text:
            return []
        name, argument = (part.strip() for part in text.split(":", 1))
        if not self.NAME.fullmatch(name):
            raise MalformedCall(f"{name!r} before the colon is not a tool's name")
        return [ToolCall(name, {self.parameters.get(name, self.argument): argument})]

    def render(self, results: list[ToolResult]) -> str:
        return "".join(f" {'' if result.failed else '= '}{result.text}\n" for result in results)


def cleaned(value: object, max_chars: int) -> tuple[str, bool]:
    """A tool's output as the text the policy reads: bytes decoded as UTF-8 with replacement characters, control
    characters other than newline and tab dropped, and at most ``max_chars`` characters (the cut said so); and whether
    it was faulty (bytes that are not UTF-8, or longer than ``max_chars``)."""
    faulty = False
    if isinstance(value, bytes | bytearray):
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text, faulty = value.decode("utf-8", errors="replace"), True
    else:
        text = str(value)
    text = "".join(c for c in text if c in "\n\t" or c.isprintable())
    if len(text) > max_chars:
        text, faulty = f"{text[:max_chars]}... [{len(text) - max_chars} more characters cut]", True
    return text, faulty


def call_tool(function: Callable, arguments: dict, timeout: float, max_chars: int) -> tuple[str, bool, bool]:
    """``function(**arguments)`` in a daemon thread: ``(text, failed, faulty_output)``. A call that raises gives its
    exception; one that runs past ``timeout`` seconds is left running and reported; an output is :func:`cleaned`."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = function(**arguments)
        except BaseException as error:  # noqa: BLE001 - the policy reads it
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True, name=f"tool-{function.__name__}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"error: {function.__name__} did not answer within {timeout:g} s", True, False
    if "error" in outcome:
        error = outcome["error"]
        return cleaned(f"error: {type(error).__name__}: {error}", max_chars)[0], True, False
    text, faulty = cleaned(outcome["value"], max_chars)
    return text, False, faulty


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """Each tool's JSON schema, as chat templates take them; ValueError naming a tool whose docstring does not describe
    it and each of its arguments, or two tools of one name."""
    schemas, names = [], set()
    for tool in tools:
        name = getattr(tool, "__name__", repr(tool))
        try:
            schema = get_json_schema(tool)
        except Exception as error:  # transformers raises its own exception types for each missing part
            raise ValueError(f"tool {name}: {error} (a tool needs a docstring with an Args section and typed arguments)") from None
        if name in names:
            raise ValueError(f"two tools are named {name}")
        names.add(name)
        schemas.append(schema)
    return schemas


class ToolEnvironment(Environment):
    """The policy calls ``tools`` until a turn calls none: that turn is its answer and ends the episode.

    Args:
        tools: the functions the policy may call, each with type hints and a docstring (``Args:`` describing every
            argument).
        calls: how calls are written and results shown; :class:`HermesCalls` when None.
        timeout: seconds a call may take.
        max_output_chars: the longest output the policy reads.
        max_calls_per_turn: calls of one turn that are run; more are answered with an error.

    Example::

        def multiply(a: int, b: int) -> int:
            \"\"\"Multiplies two integers.

            Args:
                a: the first factor.
                b: the second factor.
            \"\"\"
            return a * b

        environment = ToolEnvironment([multiply])
    """

    def __init__(self, tools: list[Callable], calls: CallFormat | None = None, timeout: float = 10.0, max_output_chars: int = 2000,
                 max_calls_per_turn: int = 8):
        if timeout <= 0 or max_output_chars < 1 or max_calls_per_turn < 1:
            raise ValueError(f"ToolEnvironment: timeout must be > 0 and max_output_chars, max_calls_per_turn >= 1, got "
                             f"{timeout}, {max_output_chars}, {max_calls_per_turn}")
        self.schemas = tool_schemas(tools)
        self.tools = {tool.__name__: tool for tool in tools}
        self.calls = (calls if calls is not None else HermesCalls()).for_tools(self.schemas)
        self.timeout, self.max_output_chars, self.max_calls_per_turn = timeout, max_output_chars, max_calls_per_turn

    def reset(self, record: Record) -> str | None:
        return None

    def step(self, action: str) -> Observation:
        try:
            calls = self.calls.parse(action)
        except MalformedCall as error:
            return Observation(self.calls.render([ToolResult("", f"error: {error}", failed=True)]), tool_calls=1, tool_errors=1)
        if not calls:
            return Observation("", done=True)
        results = [self.run(call) if index < self.max_calls_per_turn else
                   ToolResult(call.name, f"error: at most {self.max_calls_per_turn} tool calls a turn", failed=True)
                   for index, call in enumerate(calls)]
        return Observation(self.calls.render(results), tool_calls=len(results), tool_errors=sum(r.failed for r in results),
                           tool_output_faults=sum(r.faulty_output for r in results))

    def run(self, call: ToolCall) -> ToolResult:
        """One call's result; a call to no tool is an error the policy reads."""
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: no tool is named {call.name!r}; the tools are {', '.join(sorted(self.tools))}", True)
        return ToolResult(call.name, *call_tool(tool, call.arguments, self.timeout, self.max_output_chars))

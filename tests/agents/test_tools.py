"""Tools and environments: schemas from docstrings, calls read from a turn's text, every fault of a tool an observation
the policy reads (counted), TRL's environment_factory shape, and environments that raise stopping in one line."""

import json
import threading

import pytest

from lit_cancel import AdditionTask
from lit_cancel.agents import (
    ColonCalls,
    Environment,
    EnvironmentFailure,
    EnvironmentTask,
    HermesCalls,
    MalformedCall,
    Observation,
    ToolCall,
    ToolEnvironment,
    from_trl_factory,
)
from lit_cancel.agents.environment import episode_reward, reset_episode, step_episode
from lit_cancel.agents.tools import cleaned


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def fails(reason: str) -> str:
    """Raises, always.

    Args:
        reason: what the error says.
    """
    raise KeyError(reason)


released = threading.Event()


def hangs() -> str:
    """Answers once the test lets it, long after any timeout."""
    released.wait(30)
    return "late"


def floods(size: int) -> bytes:
    """Returns ``size`` bytes of output, not all of them UTF-8.

    Args:
        size: how many bytes.
    """
    return (b"ok\xff\x00\x07" * size)[:size]


def repeats(text: str, times: int) -> str:
    """Repeats a text.

    Args:
        text: what to repeat.
        times: how many times.
    """
    return text * times


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def response(*texts: str) -> str:
    """Qwen2.5's rendering of tool results, written out by hand."""
    blocks = "".join(f"\n<tool_response>\n{text}\n</tool_response>" for text in texts)
    return f"\n<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def environment():
    return ToolEnvironment([multiply, fails, hangs, floods, repeats], timeout=0.3, max_output_chars=40, max_calls_per_turn=3)


def test_a_tools_schema_comes_from_its_signature_and_docstring(environment):
    (schema, *_) = environment.schemas
    assert schema["function"]["name"] == "multiply" and schema["function"]["description"] == "Multiplies two integers."
    assert schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first factor."}, "b": {"type": "integer", "description": "the second factor."},
    }


def test_a_tool_without_a_described_argument_or_with_a_taken_name_is_refused_when_the_environment_is_built():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="^tool undocumented: .*docstring"):
        ToolEnvironment([undocumented])
    with pytest.raises(ValueError, match="two tools are named multiply"):
        ToolEnvironment([multiply, multiply])
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ToolEnvironment([multiply], timeout=0)


def test_calls_are_run_in_order_and_their_results_rendered_as_the_chat_template_does(environment):
    observation = environment.step(f"Let me compute. {call('multiply', a=12, b=34)} and {call('multiply', a=-3, b=5)}")
    assert observation == Observation(response("408", "-15"), done=False, tool_calls=2, tool_errors=0)


def test_a_turn_without_a_call_is_the_answer_and_ends_the_episode(environment):
    assert environment.step("The answer is 408.") == Observation("", done=True)


@pytest.mark.parametrize(("text", "problem"), [
    ("<tool_call>{'name': 'multiply'}</tool_call>", "a tool call is not JSON: Expecting property name enclosed in double quotes"),
    ("<tool_call>" + json.dumps({"name": "multiply", "arguments": {}}), "a <tool_call> is not closed by </tool_call>"),
    ("<tool_call>[1, 2]</tool_call>", 'a tool call must be a JSON object with a "name"'),
    ('<tool_call>{"name": "multiply", "arguments": [1, 2]}</tool_call>', 'the "arguments" of multiply must be a JSON object'),
])
def test_a_malformed_call_is_an_error_the_policy_reads(environment, text, problem):
    with pytest.raises(MalformedCall, match="^" + problem.replace("[", r"\[")):
        HermesCalls().parse(text)
    observation = environment.step(text)
    assert observation.text.startswith(response(f"error: {problem}")[:-len("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")])
    assert (observation.done, observation.tool_calls, observation.tool_errors) == (False, 1, 1)


def test_a_tool_that_raises_or_is_not_there_or_is_called_wrongly_answers_with_the_error_and_the_episode_goes_on():
    environment = ToolEnvironment([multiply, fails, hangs, floods])
    observation = environment.step(call("fails", reason="no such key") + call("divide", a=1) + call("multiply", a=2))
    assert observation == Observation(response(
        "error: KeyError: 'no such key'",
        "error: no tool is named 'divide'; the tools are fails, floods, hangs, multiply",
        "error: TypeError: multiply() missing 1 required positional argument: 'b'",
    ), tool_calls=3, tool_errors=3)


def test_a_tool_that_hangs_is_answered_after_the_timeout_and_its_late_result_is_dropped(environment):
    try:
        observation = environment.step(call("hangs") + call("multiply", a=2, b=3))
    finally:
        released.set()
    assert observation == Observation(response("error: hangs did not answer within 0.3 s", "6"), tool_calls=2, tool_errors=1)


def test_a_huge_output_that_is_not_utf8_is_cut_and_cleaned(environment):
    observation = environment.step(call("floods", size=10_000))
    # b"ok\xff\x00\x07" is "ok" and a replacement character once decoded; the NUL and the bell are dropped
    expected = ("ok\ufffd" * 14)[:40] + f"... [{3 * 2000 - 40} more characters cut]"
    assert observation == Observation(response(expected), tool_calls=1, tool_errors=0, tool_output_faults=1)
    assert cleaned("a\x1b[31mb\tc\n", 100) == ("a[31mb\tc\n", False)


def test_an_output_cut_or_not_utf8_is_counted_as_a_faulty_output_and_a_failed_call_as_an_error(environment):
    # 10 bytes that are not UTF-8; 60 characters cut at 40; 40 characters, read whole
    observation = environment.step(call("floods", size=10) + call("repeats", text="ab", times=30) + call("repeats", text="ab", times=20))
    assert (observation.tool_calls, observation.tool_errors, observation.tool_output_faults) == (3, 0, 2)
    # an error cut at 40 characters is a failed call, not a faulty output
    observation = environment.step(call("fails", reason="x" * 100))
    assert (observation.tool_calls, observation.tool_errors, observation.tool_output_faults) == (1, 1, 0)


def test_a_colon_call_fills_the_called_tools_own_parameter_whatever_its_name():
    def lookup(key: str) -> str:
        """Looks a key up.

        Args:
            key: what to look up.
        """
        return {"pi": "3.14"}[key]

    def calculate(expression: str) -> str:
        """Evaluates a sum.

        Args:
            expression: two numbers with a plus.
        """
        return str(sum(int(part) for part in expression.split("+")))

    def pad(text: str, width: int = 8) -> str:
        """Pads a text.

        Args:
            text: what to pad.
            width: how wide.
        """
        return text.rjust(width, ".")

    environment = ToolEnvironment([lookup, calculate, pad, multiply], ColonCalls())
    assert environment.step("lookup: pi") == Observation(" = 3.14\n", tool_calls=1)
    assert environment.step("calculate: 2+3") == Observation(" = 5\n", tool_calls=1)
    assert environment.step("pad: ab") == Observation(" = ......ab\n", tool_calls=1)
    # one text cannot fill two required parameters: the policy reads the error
    assert environment.step("multiply: 3").tool_errors == 1
    assert ColonCalls().parse("lookup: pi") == [ToolCall("lookup", {"expression": "pi"})], "unbound, the text fills `argument`"
    assert ColonCalls("key").for_tools(environment.schemas).parse("lookup: pi") == [ToolCall("lookup", {"key": "pi"})]


def test_calls_past_the_limit_of_a_turn_are_answered_with_an_error_and_not_run(environment):
    observation = environment.step(call("multiply", a=1, b=1) * 4)
    assert observation.text == response("1", "1", "1", "error: at most 3 tool calls a turn")
    assert (observation.tool_calls, observation.tool_errors) == (4, 1)


class Counter:
    """A TRL-shaped environment: reset(**row), public methods as tools, get_reward() from its state."""

    def reset(self, target: int, **row) -> str:
        self.target, self.count = target, 0
        return f"Count to {target}."

    def increment(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: how much to add.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)

    @property
    def unread(self) -> int:
        raise AssertionError("a property is not a tool and is never evaluated")


def test_an_environment_written_for_trls_environment_factory_runs_with_its_state_kept_per_episode():
    factory = from_trl_factory(Counter, timeout=1.0)
    first, second = factory(), factory()
    assert [schema["function"]["name"] for schema in first.schemas] == ["increment"]
    assert first.reset({"target": 5, "prompt": "..."}) == "Count to 5." and second.reset({"target": 2, "prompt": "..."})
    assert first.step(call("increment", by=2)).text == response("2")
    assert first.step(call("increment", by=3)).text == response("5")
    assert second.step(call("increment", by=3)).text == response("3")  # its own counter
    assert first.step("done") == Observation("", done=True)
    assert (first.reward(), second.reward()) == (1.0, 0.0)


def test_a_trl_environment_without_reset_or_with_an_undocumented_tool_is_refused_by_the_start_up_check_naming_its_class():
    class NoReset:
        def increment(self, by: int) -> int:
            """Adds.

            Args:
                by: how much.
            """
            return by

    class Undocumented(Counter):
        def decrement(self, by: int) -> int:
            return -by

    task = AdditionTask(num_digits=1, train_size=4, val_size=2)
    with pytest.raises(EnvironmentFailure, match="^the environment factory NoReset raised at start-up: ValueError: NoReset: an "
                                                 "environment_factory's instance must define reset"):
        EnvironmentTask(task, trl_environment=NoReset).check_environment()
    with pytest.raises(EnvironmentFailure, match="^the environment factory Undocumented raised at start-up: ValueError: tool decrement: "):
        EnvironmentTask(task, trl_environment=Undocumented).check_environment()


def test_an_environment_of_a_trl_class_is_named_by_that_class_and_its_methods():
    class Unscored(Counter):
        def get_reward(self) -> float:
            raise KeyError("count")

    environment = from_trl_factory(Unscored)()
    environment.reset({"target": 1, "prompt": "..."})
    with pytest.raises(EnvironmentFailure, match=r"^Unscored.get_reward raised on val record 2: KeyError: 'count'$"):
        episode_reward(environment, "val record 2")
    with pytest.raises(EnvironmentFailure, match=r"^Unscored.reset raised on val record 2: TypeError: .*'target'$"):
        reset_episode(environment, {"prompt": "..."}, "val record 2")


class Broken(Environment):
    def reset(self, record):
        return record["missing"]

    def step(self, action):
        if action == "text":
            return "not an observation"
        raise ZeroDivisionError("division by zero")


def test_an_environment_that_raises_or_answers_wrongly_stops_the_run_in_one_line_naming_it_the_turn_and_the_record():
    with pytest.raises(EnvironmentFailure, match=r"^Broken.reset raised on train record 3: KeyError: 'missing'$"):
        reset_episode(Broken(), {}, "train record 3")
    with pytest.raises(EnvironmentFailure, match=r"^Broken.step raised at turn 2 of train record 3: ZeroDivisionError: division by zero$"):
        step_episode(Broken(), "1/0", 2, "train record 3")
    with pytest.raises(EnvironmentFailure, match=r"^Broken.step returned str at turn 1 of train record 3; it must return an Observation$"):
        step_episode(Broken(), "text", 1, "train record 3")
    assert ToolCall("multiply", {"a": 1}) == HermesCalls().parse(call("multiply", a=1))[0]

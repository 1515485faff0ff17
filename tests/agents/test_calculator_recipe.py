"""The GSM8K calculator recipe: the calculate tool's values and refusals, its turns in Qwen2.5's tool-call format,
prompts rendered by the chat template with the tool's schema, and configs/qwen2.5-0.5b-gsm8k-calculator.yaml training on
a CPU with a stand-in model that has a Qwen2.5-Instruct chat template."""

import json
from pathlib import Path

import pytest
from conftest import QWEN_TEMPLATE

from lit_cancel import MathWordTask
from lit_cancel.agents import CalculatorEnvironment, Environment, EnvironmentTask, Observation, calculate
from lit_cancel.agents.trl_environment import dataset_row
from lit_cancel.run.cli import run_cli
from lit_cancel.tokenizer import build_char_tokenizer

TESTS = Path(__file__).parents[1]
RECIPE = TESTS.parent / "configs" / "qwen2.5-0.5b-gsm8k-calculator.yaml"


@pytest.mark.parametrize("expression, value", [
    ("(48 / 2) * 3 - 5", "67"), ("7 // 2", "3"), ("7 % 3", "1"), ("2 ** 10", "1024"), ("-3 + -(-2)", "-1"),
    ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"), ("2 ** -3", "0.125"), ("1,250 * 4", "5000"), (" 12 ", "12"),
    ("27337+03973", "31310"), ("0.05 * 100", "5"), ("100 - 007", "93"),
])
def test_calculate_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "not 'x'"),
    ("__import__('os').system('true')", "only numbers"),
    ("(1).real", "only numbers"),
    ("'a' * 3", "not \"'a'\""),
    ("True + 1", "not 'True'"),
    ("2 +", "cannot read '2 \\+' as arithmetic"),
    ("9 ** 9 ** 9", "the exponent 387420489 is too large"),
    ("(10 ** 100) ** 100", "the result is too large"),
    ("1e300 * 1e300", "the result is too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1" * 600, "600 characters"),
])
def test_calculate_refuses_what_is_not_arithmetic_in_words_the_policy_reads(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


def turn(expression: str) -> str:
    """A policy's turn that calls the calculator as Qwen2.5 writes tool calls (its stop token removed)."""
    return f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def test_a_tool_call_is_answered_as_qwen_s_chat_template_renders_the_tool_response():
    environment = CalculatorEnvironment()
    assert environment.reset({"prompt": "?"}) is None
    observation = environment.step(turn("(48 / 2) * 3 - 5"))
    assert observation == Observation("\n<|im_start|>user\n<tool_response>\n67\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                                      tool_calls=1)
    # the episode so far is the conversation the chat template renders: the turn, its stop token, the observation
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    question = {"role": "user", "content": "What is (48 / 2) * 3 - 5?"}
    call = {"name": "calculate", "arguments": {"expression": "(48 / 2) * 3 - 5"}}
    conversation = [question, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                    {"role": "tool", "name": "calculate", "content": "67"}]
    render = dict(tools=environment.schemas, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.apply_chat_template([question], **render)
    assert prompt + turn("(48 / 2) * 3 - 5") + "<|im_end|>" + observation.text == tokenizer.apply_chat_template(conversation, **render)


def test_a_refused_expression_is_an_error_the_policy_reads_and_a_turn_without_a_call_answers():
    environment = CalculatorEnvironment()
    refused = environment.step(turn("x * 2"))
    assert refused.tool_errors == 1 and "error: ValueError: only numbers" in refused.text and not refused.done
    assert environment.step("24 apples.\n#### 24").done


class Plain(Environment):
    def reset(self, record):
        return None

    def step(self, action):
        return Observation("", done=True)


def calculator_task(data_file: str, chat_template: str, environment=CalculatorEnvironment) -> EnvironmentTask:
    math = MathWordTask(data_file, data_file, prompt_template="{question}\nUse the calculate tool.")
    return EnvironmentTask(math, environment=environment, chat_template=chat_template)


def test_prompts_are_rendered_by_the_chat_template_with_the_tool_schema_and_the_rest_of_each_record_kept(
        qwen_like_path, gsm8k_file):
    task = calculator_task(gsm8k_file, qwen_like_path)
    schema = json.dumps(CalculatorEnvironment().schemas[0])
    for rendered, original in zip(task.train_records(), task.task.train_records(), strict=True):
        assert rendered["prompt"] == (
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{schema}\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            f"<|im_start|>user\n{original['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        )
        # the rest of the record kept, and the prompt as the task gave it, for a TRL environment's reset(**row)
        assert dataset_row(rendered) == original and original["prompt"].startswith("Tom has")
    assert task.train_records() is task.train_records()  # rendered once
    assert task.val_records()[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert task.reward(task.train_records()[0], "He has 3 apples.\n#### 3") == 1.0


def test_an_environment_without_tools_gets_a_chat_without_tools(qwen_like_path, gsm8k_file):
    prompt = calculator_task(gsm8k_file, qwen_like_path, environment=Plain).train_records()[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    assert "<tools>" not in prompt


def test_a_tokenizer_without_a_chat_template_or_a_missing_folder_is_refused_naming_the_option(tmp_path, tiny_model_path,
                                                                                             gsm8k_file):
    with pytest.raises(ValueError, match="chat_template=.* names a tokenizer without a chat template"):
        calculator_task(gsm8k_file, tiny_model_path).train_records()
    with pytest.raises(FileNotFoundError, match="chat_template=.* does not exist"):
        calculator_task(gsm8k_file, str(tmp_path / "absent")).val_records()


def test_the_recipe_trains_on_tool_prompts_with_a_stand_in_model(tmp_path, qwen_like_path, gsm8k_file):
    task = "--data.init_args.task.init_args."
    cli = run_cli([
        "fit", "--config", str(RECIPE), "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=2",
        f"--model.init_args.model_path={qwen_like_path}", "--model.init_args.max_new_tokens=8",
        "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=2",
        f"{task}chat_template={qwen_like_path}", f"{task}max_turn_tokens=8", f"{task}max_episode_tokens=32",
        f"{task}task.init_args.train_file={gsm8k_file}", f"{task}task.init_args.val_file={gsm8k_file}",
        f"{task}task.init_args.reward_fn=conftest.checksum_reward",
    ])
    assert cli.trainer.global_step == 2
    assert isinstance(cli.datamodule.task.environment(), CalculatorEnvironment)
    assert '"name": "calculate"' in cli.datamodule.task.train_records()[0]["prompt"]
    assert cli.trainer.callback_metrics["rollout/turns"] >= 1

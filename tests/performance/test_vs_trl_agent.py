"""The agent row of benchmarks/performance/vs_trl.py, checked without training: its TRL environment runs
ToolAdditionTask's episodes in lit_cancel, token for token, and the chat template it gives the tiny tokenizer renders
an episode as lit_cancel appends it and reads its turns back as ColonCalls does."""

import math

import pytest
import torch
from vs_trl import AGENT_MODEL, AdditionCalculator, agent_task, colon_chat_tokenizer, transcript

from lit_cancel.agents import ColonCalls, ToolAdditionTask, ToolCall, ToolResult
from lit_cancel.engines import Sampled
from lit_cancel.hub import resolve_model_path
from lit_cancel.rounds.sample import Generation, encode_prompts

TOKENIZER = colon_chat_tokenizer(str(resolve_model_path(AGENT_MODEL)))


class ScriptedAgent:
    """A policy whose turn is ``script(context text)``, closed by EOS."""

    def __init__(self, script, max_new_tokens: int = 23):
        self.tokenizer, self.stop_token_ids = TOKENIZER, [TOKENIZER.eos_token_id]
        self.script, self.max_new_tokens = script, max_new_tokens

    def sampling_options(self):
        return type("Options", (), {"max_new_tokens": self.max_new_tokens})()

    def release_engine(self):
        pass

    def rollout(self, input_ids, attention_mask, num_samples=1, greedy=False, max_new_tokens=None, keep_engine=False):
        limit = max_new_tokens or self.max_new_tokens
        pieces = []
        for ids, mask in zip(input_ids, attention_mask):
            turn = self.tokenizer(self.script(self.tokenizer.decode(ids[mask.bool()])), add_special_tokens=False)["input_ids"]
            turn = (turn + [self.tokenizer.eos_token_id])[:limit]
            pieces.append(turn + [self.tokenizer.pad_token_id] * (limit - len(turn)))
        sequences = torch.cat([input_ids, torch.tensor(pieces)], 1)
        return Generation.from_sampled(Sampled(sequences), attention_mask, 1, self.tokenizer, 0.0, self.stop_token_ids)


RECORDS = [{"prompt": "12345+67890=", "answer": "80235"}, {"prompt": "11111+22222=", "answer": "33333"},
           {"prompt": "50000+50000=", "answer": "100000"}]


def script(context: str) -> str:
    """The first problem calls the tool and copies its answer; the second answers at once; the third calls it with an
    expression that fails, then answers wrongly."""
    prompt, _, after = context.partition("=")
    if "<eos>" not in after:
        return {"12345+67890": "calculate: 12345+67890", "11111+22222": "33333", "50000+50000": "calculate: 1/0"}[prompt]
    return after.rsplit("=", 1)[-1] if prompt == "12345+67890" else "99"


def episodes(task):
    encoded = encode_prompts(TOKENIZER, RECORDS)
    return task.rollout(ScriptedAgent(script), RECORDS, encoded["input_ids"], encoded["attention_mask"])


def test_the_trl_environment_runs_tool_addition_tasks_episodes_token_for_token_with_its_rewards():
    benchmark, shipped = agent_task(), ToolAdditionTask(num_digits=5)
    ours, theirs = episodes(benchmark), episodes(shipped)
    assert benchmark.limits == shipped.limits
    for name in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.texts == theirs.texts
    assert ours.texts[0] == "calculate:12345+67890 = 80235\n80235"  # the tiny tokenizer drops the spaces of what it decodes
    assert ours.texts[2] == "calculate:1/0 error: ZeroDivisionError: division by zero\n99"
    assert all(math.isnan(r) for r in ours.rewards.tolist())  # neither environment scores: the task's reward does
    rewards = [[task.reward(r, text) for r, text in zip(RECORDS, run.texts)] for task, run in ((benchmark, ours), (shipped, theirs))]
    assert rewards == [[1.0, 1.0, 0.0]] * 2
    assert ours.stats == theirs.stats and ours.stats["rollout/tool_calls"] == 2 / 3


def test_the_chat_template_renders_an_episode_as_lit_cancel_appends_it_and_the_trl_transcript_gets_its_reward():
    calls = [{"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12345+67890"}}}]
    completion = [{"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "name": "calculate", "content": "80235"},
                  {"role": "assistant", "content": "80235"}]
    prompt = [{"role": "user", "content": "12345+67890="}]
    rendered = TOKENIZER.apply_chat_template(prompt + completion, tokenize=False)
    reply = ColonCalls().render([ToolResult("calculate", "80235")])
    assert rendered == f"12345+67890=calculate: 12345+67890<eos>{reply}80235<eos>" == "12345+67890=calculate: 12345+67890<eos> = 80235\n80235<eos>"
    assert TOKENIZER.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) == "12345+67890="
    lit_cancel = episodes(agent_task())
    row = lit_cancel.input_ids[0][lit_cancel.attention_mask[0].bool()].tolist()
    assert TOKENIZER(rendered)["input_ids"] == row  # TRL's episode is lit_cancel's, token for token
    task = agent_task()
    assert task.reward(RECORDS[0], transcript(TOKENIZER, completion)) == task.reward(RECORDS[0], lit_cancel.texts[0]) == 1.0
    assert task.reward(RECORDS[0], transcript(TOKENIZER, completion[:1])) == 0.0  # an episode that ran out of turns after a call


@pytest.mark.parametrize("turn", ["calculate: 12345+67890", "80235", "calculate:1/0", "a:b:c", "calculat: 1+2"])
def test_the_response_template_reads_a_turn_closed_by_eos_as_colon_calls_does(turn):
    prefix = TOKENIZER("12345+67890=")["input_ids"]
    parsed = TOKENIZER.parse_response(TOKENIZER(turn + "<eos>")["input_ids"], prefix=prefix, tools=[AdditionCalculator().calculate])
    calls = [ToolCall(call["function"]["name"], call["function"]["arguments"]) for call in parsed.get("tool_calls", [])]
    assert calls == ColonCalls().parse(turn)
    assert parsed.get("content", "") == ("" if calls else turn)


def test_a_turn_cut_before_its_eos_is_read_as_the_answer_so_that_trl_ends_the_episode_as_lit_cancel_does():
    parsed = TOKENIZER.parse_response(TOKENIZER("calculate: 12345+678")["input_ids"], prefix=TOKENIZER("12345+67890=")["input_ids"])
    assert "tool_calls" not in parsed and parsed["content"] == "calculate:12345+678"


def test_trl_accepts_the_template_for_its_tool_loop():
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    assert chat_template_utils.supports_tool_calling(TOKENIZER)
    assert chat_template_utils.is_chat_template_prefix_preserving(TOKENIZER)


def test_trl_trains_the_agent_row_in_float32_without_checkpointing_as_lit_cancel_does(tmp_path):
    """GRPOConfig defaults bf16 to True: left unset, TRL's side of a float32 row trains in bfloat16 autocast."""
    pytest.importorskip("trl")
    from vs_trl import agent_config

    config = agent_config(str(tmp_path), steps=2)
    limits = agent_task().limits
    assert config.bf16 is False and config.gradient_checkpointing is False
    assert config.max_tool_calling_iterations == limits.max_turns - 1 and config.max_completion_length == limits.max_episode_tokens

"""Agent programs through the run's endpoint: the key, the request checks, tokens kept as sampled across requests, the
history-rewrite rule with Qwen2.5's template and a Qwen3-style one, and a failing program failing its episode only."""

import asyncio
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from test_docs import python_blocks
from test_episodes import ScriptedPolicy

from lit_cancel.agents import HermesCalls, ProgramTask, ToolAdditionTask
from lit_cancel.agents.endpoint import ChatEndpoint, completion_body
from lit_cancel.agents.episodes import EpisodeLimits
from lit_cancel.agents.programs import ProgramLoop, run_programs
from lit_cancel.agents.task import chat_tokenizer
from lit_cancel.agents.tools import ColonCalls
from lit_cancel.rounds.sample import encode_prompts

calculator_agent = pytest.importorskip("calculator_agent")  # examples/agent_program, on the tests' path


@pytest.fixture(scope="module")
def endpoint():
    endpoint = ChatEndpoint("policy", max_request_bytes=4000)
    yield endpoint
    endpoint.shutdown()


@pytest.fixture(scope="module")
def loop():
    return ProgramLoop()


def test_the_programs_connection_pool_is_built_with_the_http_library_the_installed_openai_uses(loop):
    # openai 2 is built on httpx, openai 3 on httpx2, and both libraries may be installed (verifiers needs httpx2 beside
    # openai 2): the other library's Timeout would reach the pool unchecked, as its every field
    assert (loop.http.timeout.connect, loop.http.timeout.read, loop.http.timeout.write, loop.http.timeout.pool) == (None,) * 4


def programs_on(policy, program, records, endpoint, loop, limits, template="embedded:tiny-agent", calls=None, **options):
    """``run_programs`` of ``program`` on ``records`` with ``policy`` (a ScriptedPolicy), the chat template of the folder
    ``template`` and the embedded agent's call format unless ``calls``."""
    prompts = encode_prompts(policy.tokenizer, records)
    return run_programs(policy, program, endpoint, loop, chat_tokenizer(template), calls or ColonCalls(), limits, records,
                        prompts["input_ids"], prompts["attention_mask"], **options)


def post(url, body, key=None, raw=None):
    """``(status, body)`` of a POST of ``body`` (JSON) or ``raw`` bytes."""
    request = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {}))
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_endpoint_answers_only_the_runs_key_counts_the_refusals_and_checks_each_request(endpoint):
    endpoint.open("s1", lambda request: {"messages": request.messages})
    url = endpoint.base_url("s1") + "/chat/completions"
    assert endpoint.address.startswith("http://127.0.0.1:")
    ok = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    assert post(url, ok)[0] == 401
    assert post(url, ok, key="not-the-key")[0] == 401
    assert endpoint.taken_unauthorized() == 2 and endpoint.taken_unauthorized() == 0
    assert post(url, ok, key=endpoint.key) == (200, {"messages": [{"role": "user", "content": "hi"}]})
    status, body = post(url, None, key=endpoint.key, raw=b"x" * 4001)
    assert status == 413 and "at most 4000" in body["error"]["message"]
    assert post(url, ok | {"n": 2}, key=endpoint.key)[0] == 400
    assert post(url, ok | {"stop": ["a", "b", "c", "d", "e"]}, key=endpoint.key)[0] == 400
    assert post(url, ok | {"stop": [3]}, key=endpoint.key)[0] == 400
    assert post(url, {"messages": [{"role": "robot", "content": "x"}]}, key=endpoint.key)[1]["error"]["message"].startswith("messages[0]")
    assert post(endpoint.base_url("absent") + "/chat/completions", ok, key=endpoint.key)[0] == 404
    # tool calls' arguments, JSON text in OpenAI's format, reach the chat template as objects
    call = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}
    assert post(url, {"messages": [call]}, key=endpoint.key)[1]["messages"][0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    models = openai.OpenAI(base_url=endpoint.base_url("s1"), api_key=endpoint.key).models.list()
    assert [model.id for model in models] == ["policy"]
    endpoint.close("s1")


def test_a_streamed_request_gets_the_whole_completion_as_server_sent_events_that_the_openai_client_reassembles(endpoint):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}
    endpoint.open("s2", lambda request: completion_body("s2", 1, "policy", {"role": "assistant", "content": "sure",
                                                                            "tool_calls": [call]}, "tool_calls", 7, 3))
    client = openai.OpenAI(base_url=endpoint.base_url("s2"), api_key=endpoint.key)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2"}], stream=True,
                                                 stream_options={"include_usage": True}))
    endpoint.close("s2")
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == "sure"
    calls = [c for delta in deltas for c in delta.tool_calls or []]
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [("call_1", "add", "{\"a\": 2}")]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == 7


def addition_script(context):
    """The embedded agent's episode: a call of the sum in the prompt, then the tool's answer copied (the context read
    without its spaces, as the tokenizer decodes it)."""
    if "calculate" not in context:
        return "calculate: " + re.search(r"(\d+\+\d+)=$", context).group(1), True
    return context.rsplit("=", 1)[1].strip(), True


def test_a_program_is_trained_on_the_tokens_it_sampled_with_the_programs_messages_between_them(endpoint, loop):
    policy = ScriptedPolicy(addition_script, max_new_tokens=24)
    template = chat_tokenizer("embedded:tiny-agent")
    records = [{"prompt": "12+30=", "answer": "42"}, {"prompt": "5+6=", "answer": "12"}]
    prompts = encode_prompts(policy.tokenizer, records)
    generation = run_programs(policy, calculator_agent.run, endpoint, loop, template, ColonCalls(), EpisodeLimits(3, 24, 96),
                              records, prompts["input_ids"], prompts["attention_mask"], num_samples=2)
    ids = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = policy.tokenizer.eos_token_id
    turns = [ids("calculate: 12+30") + [eos], ids(" = 42\n"), ids("42") + [eos]]
    row = generation.input_ids[0][generation.attention_mask[0].bool()].tolist()
    assert row == ids("12+30=") + turns[0] + turns[1] + turns[2]
    completion = generation.completion_mask[0][generation.attention_mask[0, generation.prompt_length:].bool()].tolist()
    assert completion == [1] * len(turns[0]) + [0] * len(turns[1]) + [1] * len(turns[2])
    # each turn continued the episode's own ids: the program's rendering of the conversation was never re-tokenized
    assert policy.contexts[4] == ids("12+30=") + turns[0] + turns[1]
    # the program's own rewards: 5+6 is not 12
    assert generation.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert generation.texts[0].replace(" ", "") == "calculate:12+30=42\n42"  # the tiny tokenizer has no space token
    assert ToolAdditionTask().correct(records[0], generation.texts[0])
    stats = generation.stats
    assert stats["rollout/program_requests"] == 2 and stats["rollout/turns"] == 2 and stats["rollout/history_rewrites"] == 0
    assert policy.engine_calls == ["kept call", "kept call", "release"]


QUESTIONS = ["What is 2+3?", "And 4+4?"]
ADD = {"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def qwen_script(context):
    """Thinks, calls ``add`` after a question, answers after a tool's response (the context read without whitespace, as
    the tiny tokenizer decodes it)."""
    if "".join(context.split()).endswith("</tool_response><|im_end|><|im_start|>assistant"):
        return "<think>copy</think>5", True
    return '<think>add</think><tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', True


async def two_questions(client, record):
    """A chat agent: a question, the tool loop, then a second question in the same conversation."""
    tools, messages = [ADD], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        while True:
            message = (await client.chat.completions.create(model="m", messages=messages, tools=tools)).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
    return 1.0


def without_earlier_thinking(template: str) -> str:
    """Qwen2.5's template made Qwen3-like: an assistant message before the last user message is rendered without its
    ``<think>...</think>`` block."""
    last_user = ("{%- set ns = namespace(last_user=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
                 "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}")
    stripped = template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{%- set content = message.content if message.role != 'assistant' or loop.index0 > ns.last_user else "
        "message.content.split('</think>')[-1] %}{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}")
    stripped = stripped.replace("{%- if message.content %}\n            {{- '\\n' + message.content }}",
                                "{%- if message.content %}\n            {{- '\\n' + (message.content if loop.index0 > ns.last_user "
                                "else message.content.split('</think>')[-1]) }}")
    assert stripped.count("split('</think>')") == 2
    return last_user + stripped


def run_two_questions(template, endpoint, loop):
    policy = ScriptedPolicy(qwen_script, max_new_tokens=120)
    records = [{"prompt": "q"}]
    prompts = encode_prompts(policy.tokenizer, records)
    generation = run_programs(policy, two_questions, endpoint, loop, template, HermesCalls(), EpisodeLimits(8, 120, 2000),
                              records, prompts["input_ids"], prompts["attention_mask"])
    return policy, generation


def test_with_qwen25s_template_a_conversation_extends_its_episode_and_every_sampled_turn_is_trained(qwen_like_path, endpoint, loop):
    template = chat_tokenizer(str(qwen_like_path))
    policy, generation = run_two_questions(template, endpoint, loop)
    stats = generation.stats
    assert stats["rollout/history_rewrites"] == 0 and stats["rollout/untrained_policy_tokens"] == 0
    assert stats["rollout/turns"] == 4 and stats["rollout/program_requests"] == 4
    sampled = sum(len(policy.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1 for text in
                  [qwen_script("")[0], qwen_script("</tool_response><|im_end|>\n<|im_start|>assistant\n")[0]]) * 2
    assert int(generation.completion_mask[0].sum()) == sampled
    # the row's prompt is the program's first request as the template renders it
    first = template.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], tools=[ADD], add_generation_prompt=True,
                                         tokenize=False)
    assert "<tools>" in first
    assert generation.input_ids[0, : generation.prompt_length].tolist() == policy.tokenizer(first, add_special_tokens=False)["input_ids"]


def test_with_a_template_that_drops_earlier_thinking_the_next_question_starts_a_segment_and_only_it_is_trained(
        qwen_like_path, endpoint, loop):
    template = chat_tokenizer(str(qwen_like_path))
    template.chat_template = without_earlier_thinking(template.chat_template)
    policy, generation = run_two_questions(template, endpoint, loop)
    ids = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = [qwen_script("")[0], qwen_script("</tool_response><|im_end|>\n<|im_start|>assistant\n")[0]]
    stats = generation.stats
    # within a question the thinking stays (no rewrite); the second question's request drops the first's: one rewrite,
    # and the first segment's two turns are not trained
    assert stats["rollout/history_rewrites"] == 1
    assert stats["rollout/untrained_policy_tokens"] == sum(len(ids(turn)) + 1 for turn in turns)
    assert int(generation.completion_mask[0].sum()) == sum(len(ids(turn)) + 1 for turn in turns)
    prompt = policy.tokenizer.decode(generation.input_ids[0, : generation.prompt_length][
        generation.attention_mask[0, : generation.prompt_length].bool()])
    assert "<think>" not in prompt and prompt.endswith("".join((QUESTIONS[1] + "<|im_end|>\n<|im_start|>assistant\n").split()))
    # the new segment's prompt was rendered whole and continued as sampled: its context is the prompt's ids
    assert policy.contexts[2] == generation.input_ids[0, : generation.prompt_length][
        generation.attention_mask[0, : generation.prompt_length].bool()].tolist()


async def failing(client, record):
    kind = record["kind"]
    if kind == "raises":
        raise KeyError("tool server gone")
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": record["prompt"]}])
    if kind == "hangs":
        await asyncio.sleep(30)
    if kind == "text":
        return "1.0"
    if kind == "none":
        return None
    return float(reply.choices[0].message.content == "ok")


def test_a_program_that_raises_hangs_or_returns_text_fails_its_episode_only(endpoint, loop):
    records = [{"prompt": "a", "kind": kind} for kind in ("raises", "hangs", "text", "fine", "none")]
    generation = programs_on(ScriptedPolicy(lambda context: ("ok", True)), failing, records, endpoint, loop,
                             EpisodeLimits(2, 8, 32, episode_timeout=1.0), names=[f"train record {i}" for i in range(5)])
    causes = [None if failure is None else failure.cause for failure in generation.failures]
    assert causes == ["program_raised", "timeout", "reward_wrong_type", None, None]
    assert "the agent program failing raised on train record 0: KeyError: 'tool server gone'" in generation.failures[0].message
    assert "within episode_timeout=1 s" in generation.failures[1].message
    rewards = generation.rewards.tolist()
    assert rewards[:4] == [0.0, 0.0, 0.0, 1.0] and rewards[4] != rewards[4]  # None: NaN, for the task to score
    assert generation.completion_mask[:3].sum() == 0 and generation.completion_mask[3].sum() == 3


async def greedy_for_turns(client, record):
    lengths = []
    for max_tokens in (2, None, None, None):
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}] + [
            {"role": "assistant", "content": "x"}] * len(lengths), max_tokens=max_tokens)
        lengths.append((reply.choices[0].finish_reason, reply.usage.completion_tokens))
    record["lengths"] = lengths
    return 0.0


def test_a_requests_max_tokens_cuts_its_turn_and_requests_past_max_turns_get_an_empty_completion(endpoint, loop):
    records = [{"prompt": "p"}]
    programs_on(ScriptedPolicy(lambda context: ("abcdef", True)), greedy_for_turns, records, endpoint, loop, EpisodeLimits(2, 10, 200))
    # the first turn cut at 2 tokens ends the episode for training; every later request is answered empty
    assert records[0]["lengths"] == [("length", 2), ("length", 0), ("length", 0), ("length", 0)]


async def stops_at_a_bang(client, record):
    messages = [{"role": "user", "content": "go!"}]  # the stop string in the conversation before the turn that stops at it
    replies = []
    for turn in range(2):
        reply = await client.chat.completions.create(model="m", messages=messages, stop=["!"] if turn == 0 else None)
        replies.append((reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens))
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "more"}]
    record["replies"] = replies
    return 1.0


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it_and_the_program_reads_the_text_before_it(endpoint, loop):
    policy, records = ScriptedPolicy(lambda context: ("ab!cd", True)), [{"prompt": "p"}]
    generation = programs_on(policy, stops_at_a_bang, records, endpoint, loop, EpisodeLimits(2, 10, 200))
    ids = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = policy.tokenizer.eos_token_id
    assert records[0]["replies"] == [("ab", "stop", 3), ("ab!cd", "stop", 6)]
    # the first turn trains what was sampled up to the stop string, "!" included; the template's end of that reply, which
    # the policy never sampled, is not in the episode: the conversation continues after the sampled tokens
    row = generation.input_ids[0][generation.attention_mask[0].bool()].tolist()
    assert row == ids("go!") + ids("ab!") + ids("more") + ids("ab!cd") + [eos]
    assert generation.stats["rollout/history_rewrites"] == 0


def test_the_task_reads_each_programs_first_request_as_its_records_prompt_and_names_a_program_that_fails_before(qwen_like_path):
    task = ProgramTask(ToolAdditionTask(train_size=3, val_size=2), "calculator_agent.run", "embedded:tiny-agent",
                       call_format=ColonCalls())
    assert [record["prompt"] for record in task.train_records()] == [r["prompt"] for r in ToolAdditionTask(train_size=3, val_size=2).train_records()]

    async def no_request(client, record):
        if record["prompt"] == task.task.val_records()[1]["prompt"]:
            raise ConnectionError("sandbox down")
        return await calculator_agent.run(client, record)

    broken = ProgramTask(ToolAdditionTask(train_size=3, val_size=2), no_request, "embedded:tiny-agent")
    with pytest.raises(ValueError, match=r"^the agent program .*no_request raised on val record 1 before its first request: "
                                         r"ConnectionError: sandbox down$"):
        broken.check_startup()
    # with a chat template that renders more than the text, the record's prompt is the rendering, and the program still
    # gets the record as the task made it
    seen = []

    async def chat(client, record):
        seen.append(record["prompt"])
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": record["prompt"]}])
        return 1.0

    qwen = ProgramTask(ToolAdditionTask(train_size=2, val_size=1), chat, str(qwen_like_path))
    records = qwen.train_records()
    assert records[0]["prompt"].startswith("<|im_start|>system") and records[0]["prompt"].endswith("<|im_start|>assistant\n")
    policy = ScriptedPolicy(lambda context: ("ok", True))
    prompts = encode_prompts(policy.tokenizer, records)
    seen.clear()
    generation = qwen.rollout(policy, records, prompts["input_ids"], prompts["attention_mask"])
    assert seen == [r["prompt"] for r in ToolAdditionTask(train_size=2, val_size=1).train_records()]
    assert generation.input_ids[0, : generation.prompt_length][generation.attention_mask[0, : generation.prompt_length].bool()].tolist() \
        == policy.tokenizer(records[0]["prompt"], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="must be an async function"):
        ProgramTask(ToolAdditionTask(), lambda client, record: 1.0, "embedded:tiny-agent")
    with pytest.raises(ValueError, match="program='no_such_module.run' cannot be imported"):
        ProgramTask(ToolAdditionTask(), "no_such_module.run", "embedded:tiny-agent")


def test_the_program_in_the_docs_is_the_examples():
    source = Path(calculator_agent.__file__).read_text()
    block = python_blocks("docs/agents.md", "Agent programs")
    assert block.strip() and block.strip() in source

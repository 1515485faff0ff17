"""A verifiers 0.4 environment runs unchanged as an agent program (examples/verifiers_env): its requests come through the
run's endpoint, its tool runs in the environment's own tool server, and the episode's reward is the taskset's."""

import importlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from test_episodes import ScriptedPolicy

from lit_cancel.agents import HermesCalls
from lit_cancel.agents.endpoint import ChatEndpoint
from lit_cancel.agents.episodes import EpisodeLimits
from lit_cancel.agents.programs import ProgramLoop, run_programs
from lit_cancel.agents.task import chat_tokenizer
from lit_cancel.rounds.sample import encode_prompts

pytest.importorskip("verifiers")
if shutil.which("uv") is None:
    pytest.skip("verifiers runs its harness program with uv, which is not on PATH", allow_module_level=True)

EXAMPLE = Path(__file__).parents[2] / "examples" / "verifiers_env"


def add_script(context):
    """Calls ``add`` on the question's two numbers, then answers the tool's result, one too many for 17 + 25 (the context
    read without whitespace, as the tiny tokenizer decodes it)."""
    text = "".join(context.split())
    if "<tool_response>" not in text:
        a, b = re.search(r"Whatis(\d+)\+(\d+)\?", text).groups()
        return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>', True
    result = int(re.findall(r"<tool_response>(\d+)</tool_response>", text)[-1])
    return str(result + 1 if "17+25" in text else result), True


def test_a_verifiers_environment_is_a_program_whose_reward_is_the_tasksets(qwen_like_path, monkeypatch):
    # the environment's tool server is started as `python -m add_taskset`
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    program = importlib.import_module("program")
    records = [json.loads(line) for line in (EXAMPLE / "add_problems.jsonl").read_text().splitlines()[:2]]
    assert [record["answer"] for record in records] == ["5", "42"]
    policy = ScriptedPolicy(add_script, max_new_tokens=80)
    prompts = encode_prompts(policy.tokenizer, records)
    endpoint = ChatEndpoint("policy")
    try:
        generation = run_programs(policy, program.run, endpoint, ProgramLoop(), chat_tokenizer(str(qwen_like_path)), HermesCalls(),
                                  EpisodeLimits(4, 80, 2000, episode_timeout=300), records, prompts["input_ids"],
                                  prompts["attention_mask"])
    finally:
        endpoint.shutdown()
    assert generation.failures is None or generation.failures == [None, None], generation.failures
    # the taskset's @vf.reward: 2 + 3 answered 5, 17 + 25 answered 43
    assert generation.rewards.tolist() == [1.0, 0.0]
    assert generation.stats["rollout/program_requests"] == 2 and generation.stats["rollout/history_rewrites"] == 0
    ids = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = policy.tokenizer.eos_token_id
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    after_prompt = generation.attention_mask[0, generation.prompt_length:].bool()
    tokens = generation.input_ids[0, generation.prompt_length:][after_prompt]
    completion = generation.completion_mask[0][after_prompt].bool()
    # exactly the two sampled turns are trained; between them the tool server's result, as the template renders it
    assert tokens[completion].tolist() == ids(call) + [eos] + ids("5") + [eos]
    first_turn, reply = len(ids(call)) + 1, (~completion).nonzero().flatten()
    assert completion[:first_turn].all() and reply.tolist() == list(range(first_turn, int(reply[-1]) + 1))
    assert "<tool_response>5</tool_response>" in policy.tokenizer.decode(tokens[~completion])

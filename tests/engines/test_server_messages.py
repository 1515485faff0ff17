"""The trainer/server message and the server engine's checks that need no server (the engine needs no vLLM in the trainer)."""
from dataclasses import replace

import pytest

from lit_cancel import RLModule, VLLMServerEngine
from lit_cancel.engines.server_messages import RolloutRequest, ServerSampling, StaleRolloutError, parse_result
from lit_cancel.engines.server_process import free_port

OPTIONS = ServerSampling(temperature=0.7, top_p=0.9, max_new_tokens=8, stop_token_ids=(1,), extra=(("top_k", 5),))
REQUEST = RolloutRequest(prompt_ids=(5, 6, 7), num_samples=2, options=OPTIONS, seed=11, oldest_step=4)


def choice(index: int, tokens: list[int], spans: list[tuple[str, int, int]]) -> dict:
    return {
        "index": index, "token_ids": tokens, "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in spans],
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(tokens)]},
    }


def test_a_request_is_one_group_with_the_modules_sampling_options():
    body = REQUEST.body()
    assert body["token_ids"] == [5, 6, 7]
    params = body["sampling_params"]
    assert (params["n"], params["temperature"], params["top_p"], params["max_tokens"]) == (2, 0.7, 0.9, 8)
    assert (params["stop_token_ids"], params["seed"], params["logprobs"], params["top_k"]) == ([1], 11, 0, 5)
    greedy = RolloutRequest((5,), 1, ServerSampling(0.7, 0.9, 8, (1,), greedy=True), None, 0).body()["sampling_params"]
    assert (greedy["temperature"], greedy["top_p"]) == (0.0, 1.0) and "logprobs" not in greedy and "seed" not in greedy


def test_a_group_from_one_pushed_version_is_accepted_in_index_order():
    response = {"choices": [choice(1, [9, 1], [("run/2", 0, 2)]), choice(0, [8, 8, 1], [("run/2", 0, 3)])]}
    result = parse_result(response, REQUEST, {"run/1": 3, "run/2": 5}, "http://s")
    assert result.step == 5
    assert result.completion_ids == [[8, 8, 1], [9, 1]]
    assert result.logprobs == [[-0.5, -1.0, -1.5], [-0.5, -1.0]]


@pytest.mark.parametrize(("first", "second", "pushed", "message"), [
    ([("run/2", 0, 2)], [("run/3", 0, 2)], {"run/2": 5, "run/3": 6}, r"one group with weights \['run/2', 'run/3'\]"),
    ([("run/2", 0, 2)], [("run/2", 0, 1), ("run/3", 1, 2)], {"run/2": 5, "run/3": 6}, r"one group with weights"),
    ([("run/2", 0, 2)], [("run/2", 0, 2)], {"run/3": 6}, "labelled 'run/2', which this run did not push"),
    ([("default", 0, 2)], [("default", 0, 2)], {"run/2": 5}, "labelled 'default', which this run did not push"),
    ([("run/2:loading", 0, 2)], [("run/2:loading", 0, 2)], {"run/2": 5}, "while its weights were being replaced"),
    ([("run/1", 0, 2)], [("run/1", 0, 2)], {"run/1": 3}, "the weights of step 3, older than step 4"),
])
def test_a_group_from_weights_that_are_mixed_unknown_loading_or_too_old_is_refused(first, second, pushed, message):
    response = {"choices": [choice(0, [8, 1], first), choice(1, [9, 1], second)]}
    with pytest.raises(StaleRolloutError, match=message):
        parse_result(response, REQUEST, pushed, "http://s")


def test_a_group_sampled_with_a_versions_adapter_counts_as_that_version_over_this_runs_base_weights_alone():
    request = replace(REQUEST, adapter="run/2")
    assert request.body()["model"] == "run/2" and "model" not in REQUEST.body()
    response = {"choices": [choice(index, [8, 1], [("run/base", 0, 2)]) for index in range(2)]}
    assert parse_result(response, request, {"run/1": 3, "run/2": 5}, "http://s").step == 5
    with pytest.raises(StaleRolloutError, match="the weights of step 3, older than step 4"):
        parse_result(response, replace(request, adapter="run/1"), {"run/1": 3, "run/2": 5}, "http://s")
    for label in ("default", "other/base", "run/2"):
        response = {"choices": [choice(index, [8, 1], [(label, 0, 2)]) for index in range(2)]}
        with pytest.raises(StaleRolloutError, match=f"sampled with base weights labelled '{label}', not this run's"):
            parse_result(response, request, {"run/2": 5}, "http://s")


def test_a_response_with_fewer_completions_than_asked_is_refused():
    with pytest.raises(StaleRolloutError, match="returned 1 completions for a request of 2"):
        parse_result({"choices": [choice(0, [8, 1], [("run/2", 0, 2)])]}, REQUEST, {"run/2": 5}, "http://s")


@pytest.mark.parametrize(("options", "message"), [
    ({}, "give the servers' urls, or launch: true"),
    ({"urls": ["http://a:1"], "launch": True}, "give the servers' urls, or launch: true"),
    ({"urls": ["http://a:1"], "max_staleness": -1}, "max_staleness must be >= 0"),
    ({"urls": ["http://a:1"], "server_timeout": 0}, "server_timeout must be > 0 seconds"),
    ({"urls": ["http://a:1"], "server_cpus": [1]}, "are for a launched server"),
])
def test_engine_options_are_checked_when_the_engine_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        VLLMServerEngine(**options)


def test_an_unreachable_server_is_refused_at_start_up_in_one_line_with_how_to_start_one():
    url = f"http://127.0.0.1:{free_port()}"
    module = RLModule("embedded:tiny-adder", engine=VLLMServerEngine(urls=[url]))
    with pytest.raises(ValueError, match=rf"urls: no vLLM server answers at {url}; start one with: lit-cancel serve") as error:
        module.engine.check(module.policy_weights(), module.sampling_options())
    assert "\n" not in str(error.value)

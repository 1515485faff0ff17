"""Stop tokens: the tokenizer's EOS and every end-of-sequence token the model's generation config declares end a
completion, in every engine, in the completion mask and in ``rollout/frac_truncated``.

The model is the tiny adder, whose generation config here also declares ``|`` (written before the answer) an
end-of-sequence token: a completion then ends at its first ``|``, where the tokenizer's EOS alone would let it go
on to the answer."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from lit_cancel import DecodeLoop, HFGenerate, RLModule, VLLMServerEngine
from lit_cancel.batch import RolloutBatch
from lit_cancel.engines import SampleRequest
from lit_cancel.engines.vllm_servers import group_requests
from lit_cancel.hub import ASSETS
from lit_cancel.rounds.sample import stop_token_ids
from lit_cancel.rounds.statistics import round_stats
from lit_cancel.tokenizer import build_char_tokenizer

PROMPTS = ["123+456=", "999+101=", "505+505=", "78+9="]
EOS = build_char_tokenizer().eos_token_id
BAR = build_char_tokenizer().convert_tokens_to_ids("|")


@pytest.fixture(scope="module")
def bar_model(tmp_path_factory) -> str:
    """The tiny adder's folder with ``eos_token_id: [EOS, |]`` in its generation config."""
    folder = tmp_path_factory.mktemp("tiny-adder-bar")
    shutil.copytree(ASSETS / "tiny-adder", folder, dirs_exist_ok=True)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [EOS, BAR]}))
    return str(folder)


def encoded(module: RLModule) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = module.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return prompts["input_ids"], prompts["attention_mask"]


def batch_of(generation) -> RolloutBatch:
    rows = len(generation.texts)
    return RolloutBatch(generation.input_ids, generation.attention_mask, generation.completion_mask, generation.prompt_length,
                        rewards=torch.zeros(rows), advantages=torch.zeros(rows), group_ids=torch.arange(rows))


@pytest.mark.parametrize(("declared", "expected"), [(None, [EOS]), (EOS, [EOS]), (7, [EOS, 7]), ([7, EOS, 9], [EOS, 7, 9])])
def test_the_stop_tokens_are_the_tokenizers_eos_then_each_one_the_generation_config_declares(declared, expected):
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=declared))
    assert stop_token_ids(model, build_char_tokenizer()) == expected
    assert stop_token_ids(SimpleNamespace(), build_char_tokenizer()) == [EOS]


def test_a_declared_stop_token_ends_greedy_completions_alike_in_the_decode_loop_and_in_generate(bar_model):
    generations = []
    for engine in (DecodeLoop(), HFGenerate()):
        module = RLModule(bar_model, max_new_tokens=40, engine=engine)
        assert module.stop_token_ids == [EOS, BAR]
        ids, mask = encoded(module)
        generations.append(module.rollout(ids, mask, greedy=True))
    loop, generate = generations
    assert torch.equal(loop.input_ids, generate.input_ids)
    assert torch.equal(loop.completion_mask, generate.completion_mask)
    assert loop.texts == generate.texts
    # what the model writes when only EOS stops it: its steps, "|", the answer, EOS
    config = GenerationConfig(do_sample=False, max_new_tokens=40, pad_token_id=0, eos_token_id=EOS)
    free = module.policy.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    completions = loop.input_ids[:, loop.prompt_length:]
    ends = []
    for row, text in enumerate(loop.texts):
        tokens = free[row].tolist()
        assert BAR in tokens, "the tiny adder writes | before its answer"
        end = tokens.index(BAR)
        ends.append(end)
        assert completions[row, : end + 1].tolist() == tokens[: end + 1]
        assert loop.completion_mask[row, : end + 1].all() and not loop.completion_mask[row, end + 1 :].any()
        assert (completions[row, end + 1 :] == module.tokenizer.pad_token_id).all()
        assert text == module.tokenizer.decode(tokens[:end])  # "|" is no special token: the text stops before it
    assert len(set(ends)) > 1  # rows finish at different steps: the decode loop drops finished rows on the way


def test_sampled_completions_end_at_their_first_stop_token_or_at_max_new_tokens(bar_model):
    module = RLModule(bar_model, max_new_tokens=40, temperature=1.5)
    torch.manual_seed(0)
    generation = module.rollout(*encoded(module), num_samples=4)
    completions = generation.input_ids[:, generation.prompt_length:]
    for row in range(len(completions)):
        length = int(generation.completion_mask[row].sum())
        tokens = completions[row, :length].tolist()
        stops = [i for i, token in enumerate(tokens) if token in (EOS, BAR)]
        assert stops == [length - 1] or (stops == [] and length == module.max_new_tokens)


def test_rollout_frac_truncated_counts_a_completion_ended_by_a_declared_stop_token_as_ended(bar_model):
    module = RLModule(bar_model, max_new_tokens=40)
    batch = batch_of(module.rollout(*encoded(module), greedy=True))
    rows = len(batch)
    assert round_stats(batch, rows, rows, 1.0, 0.0, module.stop_token_ids)["rollout/frac_truncated"] == 0.0
    # counted by the tokenizer's EOS alone, every one of them would have been cut at max_new_tokens
    assert round_stats(batch, rows, rows, 1.0, 0.0, [EOS])["rollout/frac_truncated"] == 1.0
    module.max_new_tokens = 3  # before any "|"
    short = batch_of(module.rollout(*encoded(module), greedy=True))
    assert round_stats(short, rows, rows, 1.0, 0.0, module.stop_token_ids)["rollout/frac_truncated"] == 1.0


def test_the_server_engines_requests_carry_every_stop_token(bar_model):
    module = RLModule(bar_model, engine=VLLMServerEngine(urls=["http://127.0.0.1:9"]))
    for greedy in (False, True):
        requests = group_requests(SampleRequest(*encoded(module), 2, module.sampling_options(), greedy), 0)
        assert [request.body()["sampling_params"]["stop_token_ids"] for request in requests] == [[EOS, BAR]] * len(PROMPTS)

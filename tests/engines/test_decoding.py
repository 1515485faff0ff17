import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from lit_cancel import DecodeLoop, HFGenerate, RLModule
from lit_cancel.engines.decode_loop import logits_processors, sample_completions, supports_decode_loop
from lit_cancel.logprobs import position_ids_from_mask
from lit_cancel.lora import LoRA
from lit_cancel.tokenizer import build_char_tokenizer

PROMPTS = ["12+3=", "7+100=", "9=", "55+55="]


@pytest.fixture(scope="module")
def module(tiny_model_path):
    return RLModule(tiny_model_path, max_new_tokens=24).eval()


def encoded(module):
    prompts = module.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return prompts["input_ids"], prompts["attention_mask"]


def hf_greedy(model, ids, mask, eos, new_tokens=24):
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=eos)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def varied_model():
    """A random Qwen2 with large weights, whose greedy completions vary from token to token."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.5, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def staggered_eos(model, ids, mask) -> int:
    """An end token that greedy rows reach at different steps, so that finished rows leave the batch while others decode."""
    free = hf_greedy(model, ids, mask, eos=-1)[:, ids.shape[1]:]
    for eos in free[0].tolist():
        is_eos = torch.cat([free == eos, torch.ones(len(ids), 1, dtype=torch.bool)], 1)
        if len(set(is_eos.long().argmax(1).tolist())) > 2:
            return eos
    pytest.fail("no token ends the rows at different steps")


def test_greedy_decode_loop_gives_generates_tokens_with_rows_ending_at_different_steps(module):
    model = varied_model()
    ids, mask = encoded(module)
    eos = staggered_eos(model, ids, mask)
    expected = hf_greedy(model, ids, mask, eos)
    got = sample_completions(model, ids, mask, 1, 24, [eos], 0, logits_processors({}, 1.0, 1.0, greedy=True), greedy=True)
    assert torch.equal(got, expected)


def test_decode_step_distributions_equal_a_fresh_forward_pass(module):
    """Each step's logits (from the shared, repeated prompt cache) are those a full forward pass gives at that position."""
    model = module.policy.model
    ids, mask = encoded(module)
    captured = []
    hook = model.register_forward_hook(lambda m, a, out: captured.append(out.logits[:, -1].clone()))
    try:
        torch.manual_seed(0)
        eos = module.tokenizer.eos_token_id
        processors = logits_processors({"suppress_tokens": [eos]}, 1.0, 1.0, greedy=False)
        sequences = sample_completions(model, ids, mask, 3, 10, [eos], 0, processors)
    finally:
        hook.remove()
    assert sequences.shape == (len(PROMPTS) * 3, ids.shape[1] + 10)
    full_mask = torch.cat([mask.repeat_interleave(3, 0), torch.ones(len(sequences), 10, dtype=mask.dtype)], 1)
    with torch.no_grad():
        fresh = model(input_ids=sequences, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)).logits
    steps = torch.stack([captured[0].repeat_interleave(3, 0), *captured[1:]], 1)  # [rows, 10, V]
    torch.testing.assert_close(steps, fresh[:, ids.shape[1] - 1 : -1], atol=1e-4, rtol=1e-4)


def test_rollout_greedy_is_the_same_with_the_loop_and_with_generate(tiny_model_path):
    ids_mask = None
    results = []
    for engine in (DecodeLoop(), HFGenerate()):
        module = RLModule(tiny_model_path, max_new_tokens=16, engine=engine)
        ids_mask = ids_mask or encoded(module)
        results.append(module.rollout(*ids_mask, greedy=True))
    assert torch.equal(results[0].input_ids, results[1].input_ids)
    assert torch.equal(results[0].completion_mask, results[1].completion_mask)
    assert results[0].texts == results[1].texts


@pytest.mark.parametrize("engine", [DecodeLoop, HFGenerate])
def test_suppressed_eos_gives_full_length_completions(tiny_model_path, engine):
    eos = build_char_tokenizer().eos_token_id
    module = RLModule(tiny_model_path, max_new_tokens=12, engine=engine(), generation_kwargs={"suppress_tokens": [eos]})
    torch.manual_seed(0)
    generation = module.rollout(*encoded(module), num_samples=4)
    assert generation.completion_mask.shape == (len(PROMPTS) * 4, 12)
    assert generation.completion_mask.all()


def test_lora_policy_uses_the_loop_and_matches_generate(tiny_model_path):
    module = RLModule(tiny_model_path, max_new_tokens=16, lora=LoRA(rank=2))
    assert supports_decode_loop(module.policy.model, {})
    ids, mask = encoded(module)
    got = module.rollout(ids, mask, greedy=True).input_ids
    expected = hf_greedy(module.policy.model, ids, mask, module.tokenizer.eos_token_id, new_tokens=16)
    assert torch.equal(got[:, : expected.shape[1]], expected)


def test_other_models_and_options_fall_back_to_generate(tmp_path):
    tokenizer = build_char_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    module = RLModule(str(tmp_path), max_new_tokens=10)
    assert not supports_decode_loop(module.policy.model, {})
    ids, mask = encoded(module)
    expected = hf_greedy(module.policy.model, ids, mask, tokenizer.eos_token_id, new_tokens=10)
    got = module.rollout(ids, mask, greedy=True).input_ids
    assert torch.equal(got[:, : expected.shape[1]], expected)
    qwen_like = type("M", (), {"config": type("C", (), {"model_type": "qwen2"})()})()
    assert supports_decode_loop(qwen_like, {"suppress_tokens": [1], "min_p": 0.1})
    assert not supports_decode_loop(qwen_like, {"repetition_penalty": 1.2})


def test_repetition_penalty_is_honoured_by_generate(tiny_model_path):
    module = RLModule(tiny_model_path, max_new_tokens=16, generation_kwargs={"repetition_penalty": 1e6})
    texts = module.rollout(*encoded(module), greedy=True).texts
    # a huge penalty on every token already in the sequence: no completion repeats a character of its prompt or itself
    for prompt, text in zip(PROMPTS, texts):
        assert not set(prompt) & set(text) and len(set(text)) == len(text)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.5}, "'temperature' is set by the module"),
    ({"max_new_tokens": 5}, "'max_new_tokens' is set by the module"),
    ({"supress_tokens": [1]}, "'supress_tokens' is not a transformers GenerationConfig option"),
])
def test_generation_kwargs_are_checked(tiny_model_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RLModule(tiny_model_path, generation_kwargs=kwargs)


def test_preallocated_layer_returns_what_a_concatenating_layer_returns(monkeypatch):
    """Prefill, repeat for the samples, decode steps and dropping finished rows: the same keys and values as DynamicLayer;
    each time the buffers outgrow ones of at least _RELEASE_AFTER_GROWING bytes, the heap's free pages go back to the system."""
    from transformers.cache_utils import DynamicLayer

    from lit_cancel.engines import decode_loop
    from lit_cancel.engines.decode_loop import PreallocatedLayer

    releases = []
    monkeypatch.setattr(decode_loop, "release_free_heap", lambda: releases.append(True))
    monkeypatch.setattr(decode_loop, "_RELEASE_AFTER_GROWING", 1_000)
    torch.manual_seed(0)
    growing, preallocated = DynamicLayer(), PreallocatedLayer(capacity=12)

    def both(step):
        keys, values = torch.randn(step.shape), torch.randn(step.shape[:-1] + (3,))
        expected, got = growing.update(keys, values), preallocated.update(keys, values)
        assert all(torch.equal(e, g) for e, g in zip(expected, got))
        assert preallocated.get_seq_length() == growing.get_seq_length()

    both(torch.empty(2, 2, 5, 4))  # prefill of two prompts
    growing.batch_repeat_interleave(3)
    preallocated.batch_repeat_interleave(3)
    both(torch.empty(6, 2, 1, 4))
    keep = torch.tensor([0, 2, 5])
    buffers = preallocated.key_buffer.data_ptr(), preallocated.value_buffer.data_ptr()
    growing.batch_select_indices(keep)
    preallocated.batch_select_indices(keep)
    # finished rows leave in place: no second buffer is allocated
    assert (preallocated.key_buffer.data_ptr(), preallocated.value_buffer.data_ptr()) == buffers
    both(torch.empty(3, 2, 1, 4))
    both(torch.empty(3, 2, 2, 4))
    assert preallocated.key_buffer.shape[:3] == (3, 2, 10)  # doubled from 5 at the first decoding step, rows kept in place
    both(torch.empty(3, 2, 3, 4))
    # full: doubled again, to the capacity, holding only the rows still decoding
    assert preallocated.key_buffer.shape[:3] == (3, 2, 12) and preallocated.get_seq_length() == 12
    # grown to 5, 10 and 12 positions: the first outgrew empty buffers, the others 1,680 bytes (6 rows x 5 positions,
    # then 3 x 10, of 4 key and 3 value dimensions x 2 heads in float32)
    assert len(releases) == 2
    with pytest.raises(RuntimeError, match="holds 12 positions; position 13"):
        preallocated.update(torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 3))


def test_under_bfloat16_autocast_the_cache_holds_what_attention_reads_in_bfloat16():
    """The keys leave the rotary embedding in float32 under autocast; the cache stores them, and the values, in
    bfloat16, so attention's output is the one it computes over the float32 keys a concatenating layer returns."""
    from transformers.cache_utils import DynamicLayer

    from lit_cancel.engines.decode_loop import PreallocatedLayer

    torch.manual_seed(0)
    growing, preallocated = DynamicLayer(), PreallocatedLayer(capacity=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for positions in (5, 1, 1):
            keys, values = torch.randn(2, 2, positions, 4), torch.randn(2, 2, positions, 4).bfloat16()
            query = torch.randn(2, 2, 1, 4)
            expected, got = growing.update(keys, values), preallocated.update(keys, values)
            assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16]
            assert expected[0].dtype == torch.float32 and torch.equal(got[0], expected[0].bfloat16())
            assert torch.equal(got[1], expected[1])
            assert torch.equal(F.scaled_dot_product_attention(query, *got), F.scaled_dot_product_attention(query, *expected))
    assert preallocated.key_buffer.dtype == torch.bfloat16
    outside = PreallocatedLayer(capacity=8)
    assert outside.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))[0].dtype == torch.float32


@pytest.mark.parametrize("lora", [False, True])
def test_the_decode_loop_hands_its_cache_over_without_a_deprecation_warning(module, lora):
    import warnings

    model = varied_model()
    if lora:
        model = LoRA(rank=2, target_modules=["q_proj"]).apply(model)
    ids, mask = encoded(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sample_completions(model, ids, mask, 2, 6, [-1], 0, logits_processors({}, 1.0, 1.0, greedy=True), greedy=True)
    assert [str(w.message) for w in caught if "past_key_values" in str(w.message) or "cache" in str(w.message)] == []
    assert torch.equal(got[::2], hf_greedy(model, ids, mask, eos=-1, new_tokens=6))

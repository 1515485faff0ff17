from functools import partial

import pytest
import torch
from conftest import checkpoints_blocks
from transformers import AutoModelForCausalLM

from lit_cancel.activation_checkpointing import kept_by
from lit_cancel.logprobs import completion_logprobs


def naive(model, ids: list[int], prompt_length: int, temperature: float):
    """Log-probs and entropies of ids[prompt_length:] from full logits of one unpadded sequence."""
    logits = model(torch.tensor([ids])).logits[0, prompt_length - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(ids[prompt_length:]).unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_chunked_logprobs_match_full_logits_under_left_padding(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    prompts, completions = [[5, 6, 7, 8], [9, 10]], [[11, 12, 1], [13, 14, 15]]
    prompt_length, pad = 4, 0
    input_ids = torch.tensor([[pad] * (prompt_length - len(p)) + p + c for p, c in zip(prompts, completions)])
    attention_mask = (torch.arange(input_ids.shape[1]) >= torch.tensor([[0], [2]])).long()
    for chunk_size in (1, 4, 1024):
        logprobs, entropy = completion_logprobs(model, input_ids, attention_mask, prompt_length, 0.7, chunk_size)
        for row, (p, c) in enumerate(zip(prompts, completions)):
            expected_lp, expected_ent = naive(model, p + c, len(p), 0.7)
            assert torch.allclose(logprobs[row], expected_lp, atol=1e-5)
            assert torch.allclose(entropy[row], expected_ent, atol=1e-5)


def test_chunked_logprobs_gradient_matches_full_logits(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = [5, 6, 7, 20, 21, 22, 23]
    weights = torch.tensor([0.3, -1.0, 2.0, 0.5])
    chunked, _ = completion_logprobs(model, torch.tensor([ids]), torch.ones(1, 7, dtype=torch.long), 3, 1.0, chunk_size=3)
    (chunked[0] * weights).sum().backward()
    chunked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (naive(model, ids, 3, 1.0)[0] * weights).sum().backward()
    for chunked_grad, p in zip(chunked_grads, model.parameters()):
        assert torch.allclose(chunked_grad, p.grad, atol=1e-6)


@pytest.mark.parametrize("checkpointing, max_tokens_per_chunk", [
    (True, None), ("blocks", 6), ("chunks", 6), ("blocks+chunks", 6), ("blocks+chunks", 64),
])
def test_activation_checkpointing_gives_the_same_gradient(checkpointing, max_tokens_per_chunk):
    from lit_cancel import RLModule

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 5, 6, 7, 8, 9, 10, 11]])
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # rows of unequal length: two chunks of one row each under a budget of 6 tokens
    weights = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    gradients = []
    for mode in (False, checkpointing):
        module = RLModule("embedded:tiny-adder", activation_checkpointing=mode, max_tokens_per_chunk=max_tokens_per_chunk)
        assert checkpoints_blocks(module.policy.model) == (mode in (True, "blocks", "blocks+chunks"))
        assert module.recompute_chunks == (mode in ("chunks", "blocks+chunks"))
        logprobs, _ = module.completion_logprobs(module.policy, ids, mask, 4)
        (logprobs * weights * mask[:, 4:]).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in module.policy.parameters()]))
    assert gradients[0].abs().sum() > 0
    torch.testing.assert_close(gradients[0], gradients[1], atol=1e-6, rtol=1e-5)


def test_an_unknown_or_unbudgeted_checkpointing_mode_is_refused():
    from lit_cancel import RLModule

    with pytest.raises(ValueError, match="must be false, true, 'blocks', 'chunks', 'blocks\\+chunks' or 'auto', got 'layers'"):
        RLModule("embedded:tiny-adder", activation_checkpointing="layers")
    with pytest.raises(ValueError, match="'chunks' recomputes chunks of max_tokens_per_chunk, which is null"):
        RLModule("embedded:tiny-adder", activation_checkpointing="chunks", max_tokens_per_chunk=None)


@pytest.mark.parametrize("recompute_chunks", [False, True])
def test_a_training_pass_hands_the_heap_back_after_each_chunk_and_before_its_backward(monkeypatch, tiny_model_path, recompute_chunks):
    from lit_cancel import logprobs as logprobs_module

    events = []
    monkeypatch.setattr(logprobs_module, "release_free_heap", lambda: events.append("release"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.get_decoder().norm.register_full_backward_pre_hook(lambda module, grad: events.append("backward"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 5, 6, 7, 8, 9, 10, 11], [7, 7, 6, 5, 9, 9, 10, 12]])
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        completion_logprobs(model, ids, mask, 4, max_tokens_per_chunk=8)
    assert events == []  # a rollout's scoring pass: nothing to fragment the heap with
    logprobs, _ = completion_logprobs(model, ids, mask, 4, max_tokens_per_chunk=8, recompute_chunks=recompute_chunks)
    assert events == ["release"] * 3  # one chunk per row under a budget of 8 tokens
    events.clear()
    (logprobs * mask[:, 4:]).sum().backward()
    assert events == ["release", "backward"] * 3


def test_recomputed_chunks_leave_autograd_only_the_final_states_of_completion_tokens():
    from lit_cancel import RLModule

    torch.manual_seed(0)
    ids = torch.randint(5, 30, (8, 40))
    mask = torch.ones_like(ids)
    mask[::2, -10:] = 0
    completion_tokens = int(mask[:, 10:].sum())
    saved_bytes = {}
    for checkpointing in (False, "chunks"):
        module = RLModule("embedded:tiny-adder", activation_checkpointing=checkpointing, max_tokens_per_chunk=64)
        saved_bytes[checkpointing] = kept_by(module.policy.model, partial(module.completion_logprobs, module.policy, ids, mask, 10))
    # one float32 state per completion token (what the head needs), plus the chunks' token ids
    final_states = completion_tokens * module.policy.model.config.hidden_size * 4
    assert final_states <= saved_bytes["chunks"] <= 1.5 * final_states
    assert saved_bytes[False] > 10 * final_states  # every block's activations

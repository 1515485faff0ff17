import torch
from transformers import AutoModelForCausalLM

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


def test_activation_checkpointing_gives_the_same_gradient():
    from lit_cancel import RLModule

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 5, 6, 7, 8, 9, 10, 11]])
    mask = torch.ones_like(ids)
    weights = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    gradients = []
    for checkpointing in (False, True):
        module = RLModule("embedded:tiny-adder", activation_checkpointing=checkpointing)
        assert module.policy.model.is_gradient_checkpointing == checkpointing
        logprobs, _ = module.completion_logprobs(module.policy, ids, mask, 4)
        (logprobs * weights).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in module.policy.parameters()]))
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6)

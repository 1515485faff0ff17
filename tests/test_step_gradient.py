"""The gradient of a training step on a fixed rollout batch, against a plain full-logits computation of GRPO."""

import warnings

import pytest
import torch

from lit_cancel import GRPO, RLModule
from lit_cancel.batch import RolloutBatch
from lit_cancel.logprobs import position_ids_from_mask


def fixed_batch(module) -> RolloutBatch:
    prompts = module.tokenizer(["12+3=", "7+100=", "9="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    generation = module.rollout(prompts["input_ids"], prompts["attention_mask"], num_samples=4)
    # completions of different lengths, as if they had ended early
    completion_mask = generation.completion_mask.clone()
    for row in range(len(completion_mask)):
        completion_mask[row, 3 + row % 9 :] = 0
    input_ids, attention_mask = generation.input_ids.clone(), generation.attention_mask.clone()
    input_ids[:, generation.prompt_length :] = input_ids[:, generation.prompt_length :] * completion_mask
    attention_mask[:, generation.prompt_length :] = completion_mask
    rewards = torch.rand(len(generation.texts))
    advantages = module.objective.advantages(rewards.view(3, 4)).reshape(-1)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
        prompt_length=generation.prompt_length, rewards=rewards, advantages=advantages,
        group_ids=torch.arange(3).repeat_interleave(4), step_sequences=12.0, step_tokens=float(completion_mask.sum()),
    )


def reference_gradient(model, batch: RolloutBatch, temperature: float) -> dict[str, torch.Tensor]:
    """On-policy GRPO from whole float32 logits: -1/S sum_i A_i/|y_i| sum_t r_it, with r_it = 1 carrying the gradient of logp."""
    model.zero_grad()
    mask = batch.attention_mask
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logits = logits[:, batch.prompt_length - 1 : -1].float() / temperature
    targets = batch.input_ids[:, batch.prompt_length :]
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    completion = batch.completion_mask.float()
    per_sequence = (ratio * completion).sum(1) / completion.sum(1).clamp(min=1)
    loss = -(batch.advantages * per_sequence).sum() / batch.step_sequences
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("activation_checkpointing", [False, True, "chunks"])
@pytest.mark.parametrize("max_tokens_per_chunk", [1024, 40])  # the batch in one chunk, and in several
def test_step_gradient_equals_the_plain_computation(tiny_model_path, activation_checkpointing, max_tokens_per_chunk):
    """On-policy GRPO's credits do not depend on the log-probs: the step sends each chunk's gradient back as its forward
    ends, and Lightning's backward of the returned loss adds the last chunk's."""
    module = RLModule(tiny_model_path, objective=GRPO(), max_new_tokens=12, temperature=0.9, logprob_chunk_size=7,
                      activation_checkpointing=activation_checkpointing, max_tokens_per_chunk=max_tokens_per_chunk)
    assert module.sends_chunks_back(old_logprobs=False, sampler_logprobs=False)
    batch = fixed_batch(module)
    lengths = batch.completion_mask.sum(1)
    assert lengths.min() < lengths.max(), "the batch should hold completions of different lengths"
    model = module.policy.model
    expected = reference_gradient(model, batch, temperature=0.9)
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        out = module.training_step(batch, 0)
    out["loss"].backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-6, rtol=1e-4, msg=name)

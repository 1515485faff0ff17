from functools import partial

import lightning as L
import pytest
import torch

from lit_cancel import GRPO, AdditionTask, RLModule, RolloutDataModule
from lit_cancel.rounds.sample import encode_prompts


def small_task():
    return AdditionTask(num_digits=3, train_size=64, val_size=8, seed=0)


def make_trainer(max_steps: int, callbacks=(), **kwargs):
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks), **kwargs,
    )


class RecordingRLModule(RLModule):
    """Records the optimizer step at which each rollout was sampled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled_at_step = []

    def rollout(self, *args, **kwargs):
        self.sampled_at_step.append(self.global_step)
        return super().rollout(*args, **kwargs)


def test_rollout_completion_mask_stops_at_first_eos():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40)
    prompts = encode_prompts(module.tokenizer, small_task().train_records()[:3])
    torch.manual_seed(0)
    generation = module.rollout(prompts["input_ids"], prompts["attention_mask"], num_samples=4)
    eos, pad = module.tokenizer.eos_token_id, module.tokenizer.pad_token_id
    completions = generation.input_ids[:, generation.prompt_length :]
    assert generation.input_ids.shape[0] == 12
    assert torch.equal(generation.input_ids[0, :8], prompts["input_ids"][0])  # row i*G+k is sample k of prompt i
    for row in range(12):
        ends = (completions[row] == eos).nonzero()
        assert len(ends) > 0, "the warm-started model ends its solutions with EOS"
        end = int(ends[0])
        assert generation.completion_mask[row, : end + 1].all() and not generation.completion_mask[row, end + 1 :].any()
        assert (completions[row, end + 1 :] == pad).all()
        assert "|" in generation.texts[row] and "<eos>" not in generation.texts[row]
    assert torch.equal(generation.attention_mask[:, generation.prompt_length :], generation.completion_mask)


@pytest.mark.parametrize(("mini_batches", "expected"), [(1, [0, 1, 2, 3]), (2, [0, 2])])
def test_each_round_is_sampled_by_the_policy_after_the_previous_step(mini_batches, expected):
    """Lightning fetches a batch ahead; rollouts must still come from the current policy."""
    module = RecordingRLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    data = RolloutDataModule(small_task(), prompts_per_round=4, group_size=4, mini_batches_per_round=mini_batches)
    make_trainer(4).fit(module, datamodule=data)
    assert module.sampled_at_step == expected
    assert data.rounds_done == len(expected) and data.pending == []


class CaptureFirstBatch(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.batch = batch


def sequence_logprobs(module: RLModule, batch) -> torch.Tensor:
    with torch.no_grad():
        logprobs, _ = module.completion_logprobs(module.policy, batch.input_ids, batch.attention_mask, batch.prompt_length)
    return (logprobs * batch.completion_mask).sum(1)


def test_rl_steps_raise_logprob_of_rewarded_completions_relative_to_unrewarded():
    torch.manual_seed(0)
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=3e-4))
    # three optimizer steps on the first round's rollouts: three epochs over one round
    data = RolloutDataModule(small_task(), prompts_per_round=8, group_size=8, epochs_per_round=3, seed=3)
    capture = CaptureFirstBatch()
    trainer = make_trainer(3, callbacks=[capture])
    before = None

    class Before(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            nonlocal before
            if batch_idx == 0:
                before = sequence_logprobs(pl_module, batch)

    trainer.callbacks.append(Before())
    trainer.fit(module, datamodule=data)
    batch = capture.batch
    rewarded, unrewarded = batch.rewards > 0, batch.rewards == 0
    assert rewarded.any() and unrewarded.any(), "the round needs both rewarded and unrewarded completions"
    change = sequence_logprobs(module, batch) - before
    assert change[rewarded].mean() > change[unrewarded].mean() + 0.1


def test_reference_model_only_with_kl():
    assert RLModule("embedded:tiny-adder").reference is None
    module = RLModule("embedded:tiny-adder", objective=GRPO(kl_coef=0.1))
    assert module.reference is not None
    assert not any(p.requires_grad for p in module.reference.parameters())


def test_kl_run_logs_positive_kl_after_updates(tmp_path):
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, objective=GRPO(kl_coef=0.1),
                      optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(small_task(), prompts_per_round=4, group_size=4)
    trainer = make_trainer(3)
    trainer.fit(module, datamodule=data)
    # the first step is at the reference (KL 0); after two updates the policy has moved away
    assert trainer.callback_metrics["loss/kl"] > 0


@pytest.mark.parametrize("compile", [True, False])
def test_compile_says_that_the_first_passes_compile(tiny_model_path, caplog, compile):
    module = RLModule(tiny_model_path, compile=compile)
    module.trainer = make_trainer(1)
    with caplog.at_level("INFO"):
        module.configure_model()
        module.configure_model()  # the validation before fit, then fit: each configures the model; the notice is said once
    said = [record.getMessage() for record in caplog.records if "compile" in record.getMessage()]
    assert said == ([
        "model.init_args.compile: the decoder is compiled at its first pass of each kind (rollout, training, validation); on a CPU "
        "each can take a minute before the run goes on at full speed"
    ] if compile else [])
    assert (module.policy.model.get_decoder()._compiled_call_impl is not None) is compile

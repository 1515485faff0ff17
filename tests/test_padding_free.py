"""No compute on padding: cut batches lose the columns all their rows pad, and with ``max_tokens_per_chunk`` the
training forward runs in length-sorted chunks; the gradient of a step stays that of the whole micro-batch."""

import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_cancel import GRPO, AdditionTask, DFPOMin, LoRA, RLModule, RolloutDataModule
from lit_cancel.batch import RolloutBatch
from lit_cancel.logprobs import WIDTH_MULTIPLE, length_sorted_chunks, token_budget_chunks, widened

SPLIT_STEP = Path(__file__).parent / "workers" / "split_step.py"
BUDGET = 40  # tokens per decoder chunk: several chunks of a few rows each in the batches below


def unequal_batch(module: RLModule, off_policy: bool = False) -> RolloutBatch:
    """Three groups of four sampled completions cut to lengths 2..10, after prompts of unequal lengths."""
    prompts = module.tokenizer(["123+456=", "7+10=", "9="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    generation = module.rollout(prompts["input_ids"], prompts["attention_mask"], num_samples=4)
    prompt_length = generation.prompt_length
    lengths = torch.tensor([10, 3, 7, 2, 5, 9, 4, 8, 6, 2, 10, 3])
    completion_mask = (torch.arange(generation.completion_mask.shape[1]) < lengths.unsqueeze(1)).long()
    input_ids = generation.input_ids.clone()
    input_ids[:, prompt_length:] *= completion_mask
    attention_mask = generation.attention_mask.clone()
    attention_mask[:, prompt_length:] = completion_mask
    rewards = torch.rand(len(lengths))
    batch = RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask, prompt_length=prompt_length,
        rewards=rewards, advantages=module.objective.advantages(rewards.view(3, 4)).reshape(-1),
        group_ids=torch.arange(3).repeat_interleave(4), step_sequences=12.0, step_tokens=float(completion_mask.sum()),
    )
    if off_policy:
        # a later epoch over the round: the policy has moved away from the one that sampled, far enough to clip
        with torch.no_grad():
            current = module.token_logprobs(input_ids, attention_mask, prompt_length)
        batch.old_logprobs = (current + 0.3 * torch.randn_like(current)) * completion_mask
        batch.ref_logprobs = (current + 0.1 * torch.randn_like(current)) * completion_mask
    return batch


def step(module: RLModule, batch: RolloutBatch, max_tokens_per_chunk: int | None, pack: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """The training step's outputs and the gradient of its loss, with the decoder in chunks of ``max_tokens_per_chunk``
    (packed rows with ``pack``)."""
    module.max_tokens_per_chunk, module.pack_sequences = max_tokens_per_chunk, pack
    module.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        out = module.training_step(batch, 0)
    out["loss"].backward()
    return out, {name: p.grad.clone() for name, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("pack", [False, True], ids=["sorted", "packed"])
@pytest.mark.parametrize(
    ("objective", "lora", "off_policy"),
    [(GRPO(), None, False), (GRPO(kl_coef=0.05), None, True), (DFPOMin(), None, True), (GRPO(), LoRA(rank=2), True)],
    ids=["on-policy", "off-policy-kl", "dfpo-min", "lora"],
)
def test_chunked_step_has_the_gradient_of_the_whole_micro_batch(tiny_model_path, objective, lora, off_policy, pack):
    module = RLModule(tiny_model_path, objective=objective, lora=lora, max_new_tokens=12, temperature=0.9, logprob_chunk_size=7)
    batch = unequal_batch(module, off_policy)
    if pack:
        chunks = token_budget_chunks(batch.attention_mask, BUDGET)
    else:
        chunks = length_sorted_chunks(batch.attention_mask, batch.prompt_length, BUDGET)
    assert len(chunks) > 2 and max(map(len, chunks)) > 1  # several chunks, some holding several rows

    whole, expected = step(module, batch, None)
    chunked, gradient = step(module, batch, BUDGET, pack)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(chunked["logprobs"][mask], whole["logprobs"][mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked["entropy"][mask], whole["entropy"][mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked["credits"], whole["credits"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked["loss"], whole["loss"], rtol=1e-5, atol=1e-7)
    assert expected and any(g.abs().sum() > 0 for g in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(gradient[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunks_keep_to_the_budget_and_cover_every_row_once(tiny_model_path):
    module = RLModule(tiny_model_path, max_new_tokens=12, max_tokens_per_chunk=BUDGET)
    batch = unequal_batch(module)
    chunks = length_sorted_chunks(batch.attention_mask, batch.prompt_length, BUDGET)
    lengths = batch.completion_mask.sum(1)
    assert torch.cat(chunks).tolist() == torch.argsort(lengths, descending=True, stable=True).tolist()
    # one row wider than the budget is a chunk of its own
    assert [len(rows) for rows in length_sorted_chunks(batch.attention_mask, batch.prompt_length, 1)] == [1] * len(batch)

    # what the decoder and the head are given
    decoder_masks, head_positions = [], []
    model = module.policy.model
    model.get_decoder().register_forward_pre_hook(lambda _, args, kwargs: decoder_masks.append(kwargs["attention_mask"]), with_kwargs=True)
    model.get_output_embeddings().register_forward_hook(lambda _, args, out: head_positions.append(args[0].shape[0]))
    module.token_logprobs(batch.input_ids, batch.attention_mask, batch.prompt_length)
    assert [len(mask) for mask in decoder_masks] == [len(rows) for rows in chunks]
    spans = []
    for mask in decoder_masks:
        assert mask.numel() <= BUDGET or len(mask) == 1
        # no column that every row of the chunk pads, but for those that round its width up to a multiple of 8
        real = mask.bool().any(0)
        span = int(real.nonzero().max()) + 1
        assert real[0] and mask.shape[1] == widened(span) and mask.shape[1] % WIDTH_MULTIPLE == 0
        spans.append(span)
    assert any(span % WIDTH_MULTIPLE for span in spans)  # some chunk was widened
    assert sum(head_positions) == lengths.sum()


def test_packed_rows_keep_to_the_budget_and_the_decoder_sees_one_row_without_padding(tiny_model_path):
    module = RLModule(tiny_model_path, max_new_tokens=12, max_tokens_per_chunk=BUDGET, pack_sequences=True)
    batch = unequal_batch(module)
    chunks = token_budget_chunks(batch.attention_mask, BUDGET)
    lengths = batch.attention_mask.sum(1)
    assert torch.cat(chunks).tolist() == list(range(len(batch)))
    assert all(widened(int(lengths[rows].sum())) <= BUDGET or len(rows) == 1 for rows in chunks)
    assert [len(rows) for rows in token_budget_chunks(batch.attention_mask, 1)] == [1] * len(batch)

    calls = []
    module.policy.model.get_decoder().register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True)
    module.token_logprobs(batch.input_ids, batch.attention_mask, batch.prompt_length)
    assert len(calls) == len(chunks)
    fillers = 0
    for call, rows in zip(calls, chunks):
        tokens = int(lengths[rows].sum())
        assert call["attention_mask"] is None and call["input_ids"].shape == (1, widened(tokens))
        # positions start again at each sequence: how attention tells the packed sequences apart; a filler sequence
        # after them widens the row to a multiple of 8
        fillers += widened(tokens) > tokens
        assert (call["position_ids"][0] == 0).sum() == len(rows) + (widened(tokens) > tokens)
    assert fillers
    with pytest.raises(ValueError, match="pack_sequences needs max_tokens_per_chunk"):
        RLModule(tiny_model_path, max_tokens_per_chunk=None, pack_sequences=True)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_log_probs_are_the_unpacked_ones_with_either_cpu_attention(tiny_model_path, attention):
    module = RLModule(tiny_model_path, max_new_tokens=12, attn_implementation=attention)
    assert module.policy.model.config._attn_implementation == attention
    batch = unequal_batch(module)
    args = (batch.input_ids, batch.attention_mask, batch.prompt_length)
    whole = module.token_logprobs(*args)
    module.max_tokens_per_chunk, module.pack_sequences = BUDGET, True
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(module.token_logprobs(*args)[mask], whole[mask], rtol=1e-5, atol=1e-6)


def test_a_selected_batch_loses_the_columns_all_its_rows_pad(tiny_model_path):
    module = RLModule(tiny_model_path, max_new_tokens=12)
    batch = unequal_batch(module, off_policy=True)
    batch.sampler_logprobs = batch.old_logprobs - 0.01
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(1)
    assert prompt_lengths.min() < prompt_lengths.max()
    rows = torch.tensor([9, 4, 5])  # the shorter prompts; completions of 2, 5 and 9 tokens out of 12 columns
    picked = batch.select(rows)

    width, prompt_width = 9, int(prompt_lengths[rows].max())
    assert prompt_width < batch.prompt_length and batch.completion_mask.shape[1] > width
    assert picked.prompt_length == prompt_width
    assert picked.input_ids.shape == picked.attention_mask.shape == (3, prompt_width + width)
    columns = slice(batch.prompt_length - prompt_width, batch.prompt_length + width)
    assert torch.equal(picked.input_ids, batch.input_ids[rows, columns])
    assert torch.equal(picked.attention_mask, batch.attention_mask[rows, columns])
    for name in ("completion_mask", "old_logprobs", "ref_logprobs", "sampler_logprobs"):
        assert torch.equal(getattr(picked, name), getattr(batch, name)[rows, :width]), name
    assert torch.equal(picked.group_ids, batch.group_ids[rows]) and torch.equal(picked.advantages, batch.advantages[rows])

    # the log-probs of real tokens do not depend on the padding taken away
    with torch.no_grad():
        untrimmed = module.token_logprobs(batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length)[:, :width]
        trimmed = module.token_logprobs(picked.input_ids, picked.attention_mask, picked.prompt_length)
    mask = picked.completion_mask.bool()
    torch.testing.assert_close(trimmed[mask], untrimmed[mask], rtol=1e-5, atol=1e-6)


class RecordWidths(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def test_micro_batches_are_as_wide_as_their_own_longest_rows():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4, seed=0), prompts_per_round=8, group_size=4)
    record = RecordWidths()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, accumulate_grad_batches=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[record])
    trainer.fit(module, datamodule=data)
    assert len(record.batches) == 4
    widths = set()
    for batch in record.batches:
        width = batch.completion_mask.shape[1]
        widths.add(width)
        assert width == batch.completion_mask.sum(1).max()
        assert batch.attention_mask[:, 0].any()  # no prompt column that every row pads
        assert batch.input_ids.shape[1] == batch.prompt_length + width
    assert len(widths) > 1  # the micro-batches were cut to different widths, not to the round's


def fsdp2_gradients(out: Path, *extra: str) -> dict[str, torch.Tensor]:
    subprocess.run(
        [sys.executable, str(SPLIT_STEP), str(out), "--devices=2", "--strategy=fsdp2", "--objectives", "GRPO", "DFPOMin", *extra],
        check=True, capture_output=True, timeout=300,
    )
    return {name: result["gradient"] for name, result in torch.load(out).items()}


@pytest.mark.slow
def test_chunked_step_under_fsdp2_has_the_gradient_of_the_whole_micro_batch(tmp_path):
    whole = fsdp2_gradients(tmp_path / "whole.pt")
    # budgets of about two rows a chunk and of several: 13 chunks in the first process, 3 in the second
    chunked = fsdp2_gradients(tmp_path / "chunked.pt", "--max-tokens-per-chunk", "60", "250")
    for name, gradient in whole.items():
        assert gradient.abs().sum() > 0
        # rounding scales with the gradient (largest entry 0.1 here): one embedding entry of 2.5e-4, a sum of terms
        # near 3e-2, moves by 1.3e-7 when the rows are summed in another order
        torch.testing.assert_close(chunked[name], gradient, rtol=1e-5, atol=1e-5 * float(gradient.abs().max()), msg=name)


@pytest.mark.slow
def test_compiled_decoder_gives_the_eager_gradient_and_serves_rollouts_and_reference(tiny_model_path, tmp_path):
    """RLModule(compile=True): Trainer.fit compiles the policy's and the reference's decoders, which decode and score
    without a graph break (one inside the loop over the layers would run the whole decoder in eager Python), the
    rollouts' caches growing as they fill; a step's gradient (chunked, off-policy with KL) is the eager one up to float
    rounding."""
    from torch._dynamo.utils import counters

    from lit_cancel.module import compile_decoder

    torch._dynamo.reset()
    counters.clear()
    module = RLModule(tiny_model_path, objective=GRPO(kl_coef=0.05), max_new_tokens=12, temperature=0.9, compile=True)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=2, group_size=4)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    policy, reference = module.policy.model.get_decoder(), module.reference.model.get_decoder()
    assert policy._compiled_call_impl is not None and reference._compiled_call_impl is not None
    assert counters["stats"]["unique_graphs"] >= 2  # rollouts (no grad) and the training pass at least
    assert not counters["graph_break"], dict(counters["graph_break"])

    eager = RLModule(tiny_model_path, objective=GRPO(kl_coef=0.05), max_new_tokens=12, temperature=0.9, logprob_chunk_size=7)
    batch = unequal_batch(eager, off_policy=True)
    expected_out, expected = step(eager, batch, BUDGET)
    torch._dynamo.reset()  # else the graphs compiled during fit would serve this decoder too
    compile_decoder(eager.policy)
    graphs = counters["stats"]["unique_graphs"]
    out, gradient = step(eager, batch, BUDGET)
    assert counters["stats"]["unique_graphs"] > graphs  # the step ran the compiled decoder
    torch.testing.assert_close(out["loss"], expected_out["loss"], rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(gradient[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_widths_round_up_to_multiples_of_eight():
    assert WIDTH_MULTIPLE == 8
    assert [widened(width) for width in (0, 1, 7, 8, 9, 16, 17)] == [0, 8, 8, 8, 16, 16, 24]

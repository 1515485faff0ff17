"""An agent's episodes on Hugging Face ``generate`` and on the decode loop, and an agent run resumed mid-round."""

from functools import partial

import lightning as L
import pytest
import torch
from conftest import agent_episodes
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_cancel import GRPO, RLModule, RolloutDataModule
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.engines import DecodeLoop, HFGenerate
from lit_cancel.rounds.sample import encode_prompts


def greedy_episodes(engine):
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, engine=engine)
    task = ToolAdditionTask(train_size=16, val_size=2)
    records = task.train_records()[:8]
    prompts = encode_prompts(module.tokenizer, records)
    return task.rollout(module, records, prompts["input_ids"], prompts["attention_mask"], num_samples=1, greedy=True)


def test_greedy_episodes_on_hugging_face_generate_are_the_decode_loop_s_token_for_token():
    generated, looped = greedy_episodes(HFGenerate()), greedy_episodes(DecodeLoop())
    replies = generated.attention_mask[:, generated.prompt_length:].bool() & ~generated.completion_mask.bool()
    assert replies.any(), "the episodes need the tool's replies between turns"
    assert torch.equal(generated.input_ids, looped.input_ids)
    assert torch.equal(generated.attention_mask, looped.attention_mask)
    assert torch.equal(generated.completion_mask, looped.completion_mask)
    assert generated.texts == looped.texts


@pytest.mark.parametrize("engine", [DecodeLoop, HFGenerate], ids=["decode loop", "generate"])
def test_greedy_episodes_of_an_agent_program_are_its_environments_token_for_token(engine):
    """The calculator as an openai-SDK program through the endpoint and as the task's environment: the same rows."""
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, engine=engine())
    program, environment = (agent_episodes(module, program=program, greedy=True) for program in (True, False))
    assert torch.equal(program.input_ids, environment.input_ids)
    assert torch.equal(program.completion_mask, environment.completion_mask)
    assert torch.equal(program.attention_mask, environment.attention_mask)
    assert program.stats["rollout/tool_calls"] == environment.stats["rollout/tool_calls"] > 0
    if engine is DecodeLoop:  # each request continued its session's rows from the kept cache
        assert program.stats["perf/kv_reused_tokens"] > 0


class Trained(L.Callback):
    """Each micro-batch's groups and token ids, as the step trained them."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch.group_ids.tolist(), batch.input_ids.tolist(), batch.completion_mask.tolist()))


def fit(steps, callbacks, ckpt_path=None, **options):
    torch.manual_seed(0)
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, objective=GRPO(), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(ToolAdditionTask(train_size=64, val_size=4), prompts_per_round=4, group_size=4,
                             mini_batches_per_round=2, seed=3)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
                        **{"enable_checkpointing": False, **options})
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


def test_an_agent_run_resumed_mid_round_trains_the_same_episodes_to_the_same_weights(tmp_path):
    straight = Trained()
    uninterrupted = fit(4, [straight])
    first = Trained()
    fit(1, [first, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)], enable_checkpointing=True)
    resumed = Trained()
    # step 1 ends inside the first round (2 steps): its second mini-batch of episodes comes from the checkpoint
    module = fit(4, [resumed], ckpt_path=str(tmp_path / "epoch=0-step=1.ckpt"))
    assert first.seen + resumed.seen == straight.seen
    for (name, expected), actual in zip(uninterrupted.policy.state_dict().items(), module.policy.state_dict().values()):
        assert torch.equal(expected, actual), name

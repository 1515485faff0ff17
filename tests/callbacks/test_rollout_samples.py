"""RolloutSamplesLogger: a tiny RL run's rollouts read back from TensorBoard's event file."""

import re
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lit_cancel.callbacks import RolloutSamplesLogger
from lit_cancel.callbacks.rollout_samples import markdown_cell
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugin_util import markdown_to_safe_html
from torch import nn
from torch.utils.data import DataLoader

from lit_cancel import AdditionTask, RLModule, RolloutBatch, RolloutDataModule
from lit_cancel.tokenizer import build_char_tokenizer

TASK = AdditionTask(num_digits=3, train_size=64, val_size=8, seed=0)


class CaptureFirstMicroBatches(L.Callback):
    """The first micro-batch of every optimizer step, by step."""

    def __init__(self):
        self.batches = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.batches[trainer.global_step] = batch


def fit(tmp_path, samples: RolloutSamplesLogger, prompts_per_round: int, accumulate: int, steps: int = 3):
    capture = CaptureFirstMicroBatches()
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, accumulate_grad_batches=accumulate,
        callbacks=[samples, capture],
    )
    torch.manual_seed(0)
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    trainer.fit(module, datamodule=RolloutDataModule(TASK, prompts_per_round=prompts_per_round, group_size=4, seed=1))
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    return module, capture.batches, events


def table_rows(text: str) -> list[list[str]]:
    """The body rows of a Markdown table, cells unescaped."""
    rows = []
    for line in text.splitlines()[2:]:
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        rows.append([re.sub(r"\\(.)", r"\1", cell.strip()) for cell in cells])
    return rows


def texts_by_step(events: EventAccumulator) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("rollouts/samples/text_summary")}


def test_samples_hold_the_step_rollouts_and_sit_at_the_step_of_its_reward_scalar(tmp_path):
    samples = RolloutSamplesLogger(every_n_steps=2, num_samples=8)
    # one round of 2 prompts x 4 rollouts per step: the table holds the whole round
    module, batches, events = fit(tmp_path, samples, prompts_per_round=2, accumulate=1)
    texts = texts_by_step(events)
    assert sorted(texts) == samples.logged_steps == [0, 2]
    reward_scalar = {e.step: e.value for e in events.Scalars("rollout/reward_mean")}
    for step, text in texts.items():
        batch, rows = batches[step], table_rows(text)
        assert len(rows) == 8
        completions = batch.input_ids[:, batch.prompt_length :].masked_fill(batch.completion_mask == 0, module.tokenizer.pad_token_id)
        expected = module.tokenizer.batch_decode(completions, skip_special_tokens=True)
        assert [row[1] for row in rows] == expected
        for (prompt, completion, reward, advantage), batch_reward, batch_advantage in zip(rows, batch.rewards, batch.advantages):
            a, b = re.fullmatch(r"(\d{3})\+(\d{3})=", prompt).groups()
            assert float(reward) == TASK.reward({"answer": str(int(a) + int(b))}, completion) == batch_reward
            assert float(advantage) == pytest.approx(float(batch_advantage), abs=1e-3)
        assert {row[2] for row in rows} == {"0", "1"}, "the round needs both rewards to tell them apart"
        assert reward_scalar[step] == pytest.approx(sum(float(row[2]) for row in rows) / 8)


def test_samples_come_from_the_first_micro_batch_of_each_logged_step(tmp_path):
    samples = RolloutSamplesLogger(every_n_steps=2, num_samples=3)
    module, batches, events = fit(tmp_path, samples, prompts_per_round=4, accumulate=2)
    texts = texts_by_step(events)
    assert sorted(texts) == [0, 2]
    for step, text in texts.items():
        batch = batches[step]
        completions = [module.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                       for ids, mask in zip(batch.input_ids[:3, batch.prompt_length :], batch.completion_mask[:3])]
        assert [row[1] for row in table_rows(text)] == completions


def test_without_tensorboard_it_warns_once_and_writes_nothing(tmp_path):
    samples = RolloutSamplesLogger(every_n_steps=1)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[samples])
    with pytest.warns(UserWarning, match="no TensorBoardLogger") as record:
        trainer.fit(RLModule("embedded:tiny-adder", max_new_tokens=40),
                    datamodule=RolloutDataModule(TASK, prompts_per_round=2, group_size=4))
    assert len([w for w in record if "RolloutSamplesLogger" in str(w.message)]) == 1
    assert samples.logged_steps == []


def test_a_cell_renders_its_text_literally_in_tensorboard():
    text = "7+5+0=12|432 *x_1* [a](b) `c` \\frac{1}{2}\nnext"
    html = markdown_to_safe_html(f"| a |\n|---|\n| {markdown_cell(text)} |\n")
    cell = re.search(r"<td>(.*)</td>", html, re.S).group(1)
    assert cell == "7+5+0=12|432 *x_1* [a](b) `c` \\frac{1}{2}<br>next"


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"num_samples": 0}, {"tag": ""}])
def test_bad_arguments_fail_at_construction(kwargs):
    with pytest.raises(ValueError, match="RolloutSamplesLogger"):
        RolloutSamplesLogger(**kwargs)


class ForeignModule(L.LightningModule):
    """A model outside lit_cancel whose finite epochs of 5 batches meet RolloutSamplesLogger's contract."""

    def __init__(self):
        super().__init__()
        self.tokenizer = build_char_tokenizer()
        self.weight = nn.Parameter(torch.zeros(1))
        self.steps_at_batch_start: list[int] = []
        ids = torch.tensor(self.tokenizer(["1+2=3", "2+2=4"], add_special_tokens=False)["input_ids"])
        self.batch = {"input_ids": ids, "prompt_length": 4, "completion_mask": torch.ones(2, 1), "rewards": torch.ones(2),
                      "advantages": torch.zeros(2)}

    def on_train_batch_start(self, batch, batch_idx):
        self.steps_at_batch_start.append(self.trainer.global_step)

    def training_step(self, batch, batch_idx):
        self.log("loss", (self.weight - 1) ** 2)
        return (self.weight - 1) ** 2

    def train_dataloader(self):
        return DataLoader([self.batch] * 5, batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_with_accumulation_and_an_odd_epoch_it_logs_once_per_optimizer_step_at_the_global_step(tmp_path):
    samples, module = RolloutSamplesLogger(every_n_steps=1, num_samples=1), ForeignModule()
    logger = TensorBoardLogger(tmp_path, name="foreign")
    trainer = L.Trainer(max_steps=7, accelerator="cpu", logger=logger, log_every_n_steps=1, accumulate_grad_batches=2,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[samples])
    trainer.fit(module)
    # 5 batches an epoch: steps of 2, 2 and 1 micro-batches
    assert sorted(set(module.steps_at_batch_start)) == samples.logged_steps == list(range(7))
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert sorted(texts_by_step(events)) == list(range(7))


def episode_batch(attention_on_padding: bool = False) -> dict:
    """Two rows after the prompt ``guess:``: an episode ``50``, the environment's ``higher``, ``75``; and a single turn ``42``,
    right-padded (its padding inside ``attention_mask`` when ``attention_on_padding``)."""
    tokenizer = build_char_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt, episode, single = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("guess:", "50higher75", "42"))
    episode, single = episode + [eos], single + [eos] + [pad] * 8
    completion_mask = torch.tensor([[1, 1] + [0] * 6 + [1, 1, 1], [1, 1, 1] + [0] * 8])
    attention = torch.tensor([[1] * 11, [1] * 11 if attention_on_padding else [1, 1, 1] + [0] * 8])
    return {"input_ids": torch.tensor([prompt + episode, prompt + single]), "prompt_length": len(prompt),
            "attention_mask": torch.cat([torch.ones(2, len(prompt), dtype=torch.long), attention], 1),
            "completion_mask": completion_mask, "rewards": torch.tensor([1.0, 0.0]), "advantages": torch.tensor([1.0, -1.0])}


class EpisodeModule(ForeignModule):
    """ForeignModule, its batch a multi-turn episode and a single turn."""

    def __init__(self):
        super().__init__()
        self.batch = episode_batch()


def test_an_episode_shows_the_environments_observation_in_place_and_marked(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="episodes")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[RolloutSamplesLogger(every_n_steps=1)])
    trainer.fit(EpisodeModule())
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    text = texts_by_step(events)[0]
    assert [row[:2] for row in table_rows(text)] == [["guess:", "50⟦env: higher⟧75"], ["guess:", "42"]]
    assert "<td>50⟦env: higher⟧75</td>" in markdown_to_safe_html(text)


def test_a_completion_without_an_attention_mask_or_with_one_over_its_padding_is_its_policy_tokens():
    samples, tokenizer = RolloutSamplesLogger(), build_char_tokenizer()
    batch = episode_batch(attention_on_padding=True)
    without = {key: value for key, value in batch.items() if key != "attention_mask"}
    assert table_rows(samples.table(tokenizer, {}, batch))[1][1] == "42"  # padding decodes to nothing: no empty ⟦env: ⟧
    assert [row[1] for row in table_rows(samples.table(tokenizer, {}, without))] == ["5075", "42"]


def test_a_failed_episode_says_it_failed_and_why_with_what_its_context_holds():
    samples, tokenizer = RolloutSamplesLogger(), build_char_tokenizer()
    batch = episode_batch()
    batch["completion_mask"][0] = 0  # a failed episode's row has no policy token to credit
    batch["failures"] = ["step_raised", None]
    rows = table_rows(samples.table(tokenizer, {}, batch))
    assert [row[1] for row in rows] == ["⟦failed: step_raised⟧50higher75", "42"]
    # lit_cancel's batch says why by its failure codes
    assert RolloutBatch(**{key: batch[key] for key in ("input_ids", "completion_mask", "prompt_length", "rewards", "advantages")},
                        attention_mask=batch["attention_mask"], group_ids=torch.zeros(2), failure=torch.tensor([5, 0])
                        ).failures == ["step_raised", None]

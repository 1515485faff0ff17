"""The health callbacks on a model that is not a lit_cancel module: a bigram table trained on given credits."""

import ast
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_cancel.callbacks import EntropyCollapseMonitor, LearningTaxMonitor, SolutionProbabilityDriftMonitor, TokenFlipMonitor

VOCAB = 12
CALLBACKS_DIR = Path(__file__).parents[1] / "callbacks"


class BigramPolicy(L.LightningModule):
    """``p(next | previous token) = softmax(table[previous])``, trained on the batch's own credits.

    It meets the callbacks' contract and nothing more; its loss is ``-sum c logp``, so the
    credits it returns are exactly its gradient's weights.
    """

    def __init__(self, batches: list[dict], lr: float = 1.0):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(VOCAB, VOCAB))
        self.batches, self.lr = batches, lr

    def _logprobs(self, input_ids, prompt_length):
        log_dist = torch.log_softmax(self.table[input_ids[:, prompt_length - 1 : -1]], -1)
        return log_dist.gather(-1, input_ids[:, prompt_length:, None]).squeeze(-1), log_dist

    def token_logprobs(self, input_ids, attention_mask, prompt_length):
        with torch.no_grad():
            return self._logprobs(input_ids, prompt_length)[0]

    def next_token_logprobs(self, input_ids, attention_mask, positions):
        with torch.no_grad():
            return torch.log_softmax(self.table[input_ids[positions[:, 0], positions[:, 1]]], -1)

    def sequence_logprobs(self, prompts, completions):
        ids = [torch.tensor([ord(c) % VOCAB for c in p + s]) for p, s in zip(prompts, completions)]
        with torch.no_grad():
            return torch.stack([self._logprobs(i[None], len(p))[0].sum() for i, p in zip(ids, prompts)])

    def training_step(self, batch, batch_idx):
        prompt_length = batch["prompt_length"]
        logprobs, log_dist = self._logprobs(batch["input_ids"], prompt_length)
        mask = batch["completion_mask"]
        return {
            "loss": -(batch["credits"] * logprobs * mask).sum(),
            "credits": batch["credits"] * mask,
            "logprobs": logprobs.detach(),
            "entropy": -(log_dist.exp() * log_dist).sum(-1).detach(),
            "completion_mask": mask,
            "completion_ids": batch["input_ids"][:, prompt_length:],
            "advantages": batch["advantages"],
            "group_ids": batch["group_ids"],
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "prompt_length": prompt_length,
        }

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def group_batch(credits: list[list[float]], completions: list[list[int]], advantages: list[float]) -> dict:
    """One group: prompt [1, 3], then the given completions (equal lengths)."""
    completion = torch.tensor(completions)
    rows = len(completions)
    input_ids = torch.cat([torch.tensor([[1, 3]] * rows), completion], 1)
    return {
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "prompt_length": 2,
        "completion_mask": torch.ones_like(completion), "credits": torch.tensor(credits),
        "advantages": torch.tensor(advantages), "group_ids": torch.zeros(rows, dtype=torch.long),
    }


# shared prefix [5, 6]; the members then diverge (7 vs 9, 8 vs 10); contexts of the shared tokens: 3 and 5
COMPLETIONS = [[5, 6, 7, 8], [5, 6, 9, 10]]
EXCHANGEABLE = [[0.5, 0.5, 1.0, 0.2], [-0.5, -0.5, -1.0, -0.2]]
NOT_EXCHANGEABLE = [[0.5, 0.5, 1.0, 0.0], [-0.5, -0.25, -1.0, 0.0]]


def fit(module, callbacks, steps, **options):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **options)
    trainer.fit(module)
    return trainer


def test_learning_tax_is_zero_for_exchangeable_credits_and_drift_with_it():
    monitor = LearningTaxMonitor(kl_every_n_steps=1)
    fit(BigramPolicy([group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])]), [monitor], 1)
    assert monitor.last_tax == 0.0
    # the shared contexts' rows of the table get credits that cancel: the step does not move them
    assert monitor.last_shared_kl == pytest.approx(0.0, abs=1e-12)


def test_learning_tax_has_its_hand_computed_value_for_non_exchangeable_credits():
    monitor = LearningTaxMonitor(kl_every_n_steps=1)
    fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])]), [monitor], 1)
    # shared positions 0 and 1: |0.5 - 0.5| + |0.5 - 0.25| = 0.25 of |c| summed = 3.75
    assert monitor.last_tax == pytest.approx(0.25 / 3.75)
    # the uncancelled 0.25 moves the context after token 5: KL(before || after) there, by hand
    grad = 0.25 * (torch.nn.functional.one_hot(torch.tensor(6), VOCAB) - torch.full((VOCAB,), 1 / VOCAB))
    before, after = torch.full((VOCAB,), -math.log(VOCAB)), torch.log_softmax(grad, 0)
    # two shared contexts (after 3: net credit 0, after 5: net 0.25), averaged
    expected = float((before.exp() * (before - after)).sum()) / 2
    assert monitor.last_shared_kl == pytest.approx(expected, rel=1e-5)


def test_learning_tax_alert_stops_training():
    monitor = LearningTaxMonitor(max_tax=0.01, action="stop")
    trainer = fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 5), [monitor], 5)
    assert monitor.alerted and trainer.global_step == 1


def test_entropy_of_a_uniform_policy_and_collapse_alert():
    monitor = EntropyCollapseMonitor(min_ratio=0.5, action="stop")
    # a large step on one member's tokens makes the policy nearly deterministic there
    batches = [group_batch([[20.0] * 4, [20.0] * 4], COMPLETIONS, [1.0, 1.0])] * 6
    trainer = fit(BigramPolicy(batches), [monitor], 6)
    assert monitor.baseline == pytest.approx(math.log(VOCAB))  # uniform over 12 tokens at the first step
    assert monitor.alerted and trainer.global_step < 6
    assert monitor.last_ratio < 0.5


def test_entropy_baseline_is_kept_in_the_checkpoint():
    monitor = EntropyCollapseMonitor(baseline_steps=2)
    fit(BigramPolicy([group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 3, lr=0.1), [monitor], 3)
    restored = EntropyCollapseMonitor(baseline_steps=2)
    restored.load_state_dict(monitor.state_dict())
    assert restored.baseline == monitor.baseline and len(restored.baseline_values) == 2


class KeepTable(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = pl_module.table.detach().clone()


def test_token_flip_fractions_of_a_constructed_update():
    flips, keep = TokenFlipMonitor(every_n_steps=1), KeepTable()
    # member 0 (A > 0) is reinforced, member 1 (A < 0) pushed down; their shared tokens cancel
    batch = group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])
    module = BigramPolicy([batch], lr=0.5)
    fit(module, [keep, flips], 1)
    # independent recomputation of delta from the table before and after the step
    after = module.token_logprobs(batch["input_ids"], None, 2)
    module.table.data.copy_(keep.before)
    delta = after - module.token_logprobs(batch["input_ids"], None, 2)
    shared = torch.tensor([[True, True, False, False]] * 2)
    assert delta[0, 2:].gt(0).all() and delta[1, 2:].lt(0).all()  # own tokens follow the advantage
    assert delta[shared].abs().max() < 1e-6  # shared tokens do not move
    assert flips.last["boosted_positive"] == pytest.approx(float((delta[0] > 0).float().mean()))
    assert flips.last["suppressed_negative"] == pytest.approx(float((delta[1] < 0).float().mean()))
    assert flips.last["boosted_specific"] == pytest.approx(0.5) and flips.last["suppressed_specific"] == pytest.approx(0.5)
    assert flips.last["boosted_shared"] == 0.0 and flips.last["suppressed_shared"] == 0.0
    assert flips.last["mean_abs_change"] == pytest.approx(float(delta.abs().mean()))


def test_solution_drift_log_odds_and_preference_entropy_of_a_constructed_probe():
    # characters map to token ids by ord % 12: "a" -> 1, "x" -> 0, "y" -> 1, "z" -> 2
    probes = [{"prompt": "a", "solutions": ["xy", "xz"]}, {"prompt": "a", "solutions": ["x"]}]
    monitor = SolutionProbabilityDriftMonitor(probes=probes, every_n_steps=1)
    module = BigramPolicy([group_batch([[0.0, 0.0, 0.0, 0.0]], [[0, 1, 0, 0]], [1.0])] * 2, lr=1.0)
    module.batches = [{**b, "input_ids": torch.tensor([[1, 1, 0, 1]]), "completion_mask": torch.tensor([[1, 1]]),
                       "credits": torch.tensor([[0.0, 2.0]]), "prompt_length": 2} for b in module.batches]
    fit(module, [monitor], 2)
    # two steps reinforce "y" after "x": table[0] += 2 (e_y - p) each step; "z" after "x" loses
    table = module.table.detach()
    log_p_x = torch.log_softmax(table[1], 0)[0]
    log_p = torch.log_softmax(table[0], 0)
    log_odds = float(log_p[1] - log_p[2])
    assert monitor.start_entropy == pytest.approx(math.log(2))  # equal at the start
    assert monitor.last["log_odds"] == pytest.approx(abs(log_odds), rel=1e-5) and log_odds > 0
    preference = torch.softmax(torch.tensor([log_p[1], log_p[2]]), 0)
    assert monitor.last["preference_entropy"] == pytest.approx(float(-(preference * preference.log()).sum()), rel=1e-5)
    start = torch.tensor([-2 * math.log(VOCAB), -2 * math.log(VOCAB), -math.log(VOCAB)])
    now = torch.stack([log_p_x + log_p[1], log_p_x + log_p[2], log_p_x])
    assert monitor.last["logprob_change"] == pytest.approx(float((now - start).mean()), rel=1e-5)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EntropyCollapseMonitor(min_ratio=1.5), "min_ratio must be in"),
        (lambda: EntropyCollapseMonitor(action="explode"), "action must be 'warn' or 'stop'"),
        (lambda: LearningTaxMonitor(max_tax=0), "max_tax must be in"),
        (lambda: LearningTaxMonitor(kl_every_n_steps=-1), "kl_every_n_steps >= 0"),
        (lambda: TokenFlipMonitor(every_n_steps=0), "every_n_steps must be >= 1"),
        (lambda: SolutionProbabilityDriftMonitor(probes=[{"prompt": "a"}]), r"probes\[0\] must be a dict with a 'prompt'"),
        (lambda: SolutionProbabilityDriftMonitor(min_entropy_ratio=0), "min_entropy_ratio must be in"),
    ],
)
def test_callback_arguments_are_checked(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_no_callback_file_imports_lit_cancel():
    for path in CALLBACKS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(alias.name.split(".")[0] == "lit_cancel" for alias in node.names), path.name
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] != "lit_cancel", path.name

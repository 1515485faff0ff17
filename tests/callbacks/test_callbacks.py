"""The health callbacks on a model that is not a lit_cancel module: a bigram table trained on given credits."""

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lit_cancel.callbacks import EntropyCollapseMonitor, LearningTaxMonitor, SolutionProbabilityDriftMonitor, TokenFlipMonitor, token_flip
from torch import nn
from torch.utils.data import DataLoader

from lit_cancel.objectives.audit import learning_tax, shared_positions

VOCAB = 12
CALLBACKS_DIR = Path(__file__).parents[2] / "callbacks"


class BigramPolicy(L.LightningModule):
    """``p(next | previous token) = softmax(table[previous])``, trained on the batch's own credits.

    It meets the callbacks' contract and nothing more: its training step returns what it computed
    (loss, credits, log-probs, entropy) and the callbacks read the rest from the batch. Its loss is
    ``-sum c logp``, so the credits it returns are exactly its gradient's weights. With ``dropout``
    the logits of the training pass are noisy, as a transformer's are.
    """

    def __init__(self, batches: list[dict], lr: float = 1.0, dropout: float = 0.0):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(VOCAB, VOCAB))
        self.dropout = nn.Dropout(dropout)
        self.batches, self.lr = batches, lr
        self.seen: list[tuple[bool, bool, bool]] = []  # (grad enabled, training, autocast) in each extra pass

    def _logprobs(self, input_ids, prompt_length):
        log_dist = torch.log_softmax(self.dropout(self.table[input_ids[:, prompt_length - 1 : -1]]), -1)
        return log_dist.gather(-1, input_ids[:, prompt_length:, None]).squeeze(-1), log_dist

    def _record(self):
        self.seen.append((torch.is_grad_enabled(), self.dropout.training, torch.is_autocast_enabled("cpu")))

    def token_logprobs(self, input_ids, attention_mask, prompt_length):
        self._record()
        return self._logprobs(input_ids, prompt_length)[0]

    def next_token_logprobs(self, input_ids, attention_mask, positions):
        self._record()
        return torch.log_softmax(self.dropout(self.table[input_ids[positions[:, 0], positions[:, 1]]]), -1)

    def sequence_logprobs(self, prompts, completions):
        """Prompts and completions are token ids, or strings whose characters map to ``ord(c) % 12``; no EOS."""
        self._record()
        def ids(piece):
            return [ord(c) % VOCAB for c in piece] if isinstance(piece, str) else piece

        return torch.stack([
            self._logprobs(torch.tensor([ids(p) + ids(s)]), len(ids(p)))[0].sum() for p, s in zip(prompts, completions)
        ])

    def training_step(self, batch, batch_idx):
        assert self.dropout.training  # the callbacks' extra passes restored the mode
        logprobs, log_dist = self._logprobs(batch["input_ids"], batch["prompt_length"])
        credits = batch["credits"] * batch["completion_mask"]
        return {
            "loss": -(credits * logprobs).sum(),
            "credits": credits,
            "logprobs": logprobs.detach(),
            "entropy": -(log_dist.exp() * log_dist).sum(-1).detach(),
        }

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def group_batch(credits: list[list[float]], completions: list[list[int]], advantages: list[float], group: int = 0) -> dict:
    """One group: prompt [1, 3], then the given completions (equal lengths)."""
    completion = torch.tensor(completions)
    rows = len(completions)
    input_ids = torch.cat([torch.tensor([[1, 3]] * rows), completion], 1)
    return {
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "prompt_length": 2,
        "completion_mask": torch.ones_like(completion), "credits": torch.tensor(credits),
        "advantages": torch.tensor(advantages), "group_ids": torch.full((rows,), group),
    }


# shared prefix [5, 6]; the members then diverge (7 vs 9, 8 vs 10); contexts of the shared tokens: 3 and 5
COMPLETIONS = [[5, 6, 7, 8], [5, 6, 9, 10]]
EXCHANGEABLE = [[0.5, 0.5, 1.0, 0.2], [-0.5, -0.5, -1.0, -0.2]]
NOT_EXCHANGEABLE = [[0.5, 0.5, 1.0, 0.0], [-0.5, -0.25, -1.0, 0.0]]


def fit(module, callbacks, steps, **options):
    options = {"logger": False, **options}
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **options)
    trainer.fit(module)
    return trainer


def test_learning_tax_is_zero_for_exchangeable_credits_and_drift_with_it():
    monitor = LearningTaxMonitor(kl_every_n_steps=1)
    fit(BigramPolicy([group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])]), [monitor], 1)
    assert monitor.last_tax == 0.0
    # the shared contexts' rows of the table get credits that cancel: the step does not move them
    assert monitor.last_shared_kl == pytest.approx(0.0, abs=1e-12)


def shared_context_kl(net_credit: float) -> float:
    """KL(before || after) at a uniform context whose row got ``net_credit`` on token 6, by hand."""
    grad = net_credit * (torch.nn.functional.one_hot(torch.tensor(6), VOCAB) - torch.full((VOCAB,), 1 / VOCAB))
    before, after = torch.full((VOCAB,), -math.log(VOCAB)), torch.log_softmax(grad, 0)
    return float((before.exp() * (before - after)).sum())


def test_learning_tax_has_its_hand_computed_value_for_non_exchangeable_credits():
    monitor = LearningTaxMonitor(kl_every_n_steps=1)
    fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])]), [monitor], 1)
    # shared positions 0 and 1: |0.5 - 0.5| + |0.5 - 0.25| = 0.25 of |c| summed = 3.75
    assert monitor.last_tax == pytest.approx(0.25 / 3.75)
    # the uncancelled 0.25 moves the context after token 5; two shared contexts (after 3: net 0), averaged
    assert monitor.last_shared_kl == pytest.approx(shared_context_kl(0.25) / 2, rel=1e-5)


def test_learning_tax_warns_once_when_no_group_has_two_members():
    singletons = {**group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0]), "group_ids": torch.tensor([0, 1])}
    monitor = LearningTaxMonitor(kl_every_n_steps=0)
    with pytest.warns(UserWarning, match="no group has two members") as record:
        fit(BigramPolicy([singletons] * 3), [monitor], 3)
    assert monitor.last_tax == 0.0
    assert [str(w.message) for w in record if "LearningTaxMonitor" in str(w.message)] == [
        "LearningTaxMonitor at step 0: no group has two members in this step's micro-batches (every group_ids value appears "
        "once), so no token is shared and the tax 0.0 measures nothing; give the rows of one prompt the same group id (warned once)"
    ]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_learning_tax_of_credits_that_are_not_finite_is_nan_and_says_why(bad):
    credits = [row[:] for row in NOT_EXCHANGEABLE]
    credits[1][3] = bad
    monitor = LearningTaxMonitor(kl_every_n_steps=0)
    batches = [group_batch(credits, COMPLETIONS, [1.0, -1.0]), group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])]
    with pytest.warns(UserWarning, match="not finite") as record:
        fit(BigramPolicy(batches[:1]), [monitor], 1)
    assert math.isnan(monitor.last_tax)
    assert [str(w.message) for w in record if "LearningTaxMonitor" in str(w.message)] == [
        "LearningTaxMonitor at step 0: 1 completion tokens have credits that are not finite (NaN or inf), so its learning tax is "
        "NaN, not a measure: the training step's loss, advantages or importance ratios were not finite (warned once)"
    ]
    fit(BigramPolicy(batches[1:]), [monitor], 1)  # the next finite step is measured again
    assert monitor.last_tax == pytest.approx(0.25 / 3.75)


def test_learning_tax_of_real_groups_does_not_warn_about_groups():
    monitor = LearningTaxMonitor(kl_every_n_steps=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 2), [monitor], 2)
    assert not [w for w in record if "no group has two members" in str(w.message)]


def test_learning_tax_alert_stops_training():
    monitor = LearningTaxMonitor(max_tax=0.01, action="stop")
    trainer = fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 5), [monitor], 5)
    assert monitor.alert_steps == [0] and trainer.global_step == 1


def test_entropy_of_a_uniform_policy_and_collapse_alert():
    monitor = EntropyCollapseMonitor(min_ratio=0.5, action="stop")
    # a large step on one member's tokens makes the policy nearly deterministic there
    batches = [group_batch([[20.0] * 4, [20.0] * 4], COMPLETIONS, [1.0, 1.0])] * 6
    trainer = fit(BigramPolicy(batches), [monitor], 6)
    assert monitor.baseline == pytest.approx(math.log(VOCAB))  # uniform over 12 tokens at the first step
    assert monitor.alert_steps and trainer.global_step < 6
    assert monitor.last_ratio < 0.5


def test_entropy_baseline_is_kept_in_the_checkpoint():
    monitor = EntropyCollapseMonitor(baseline_steps=2)
    fit(BigramPolicy([group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 3, lr=0.1), [monitor], 3)
    restored = EntropyCollapseMonitor(baseline_steps=2)
    restored.load_state_dict(monitor.state_dict())
    assert restored.baseline == monitor.baseline and len(restored.baseline_values) == 2


class KeepTable(L.Callback):
    """The table at the start of each optimizer step (micro-batches of one step see the same table)."""

    def __init__(self):
        self.before = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.setdefault(trainer.global_step, pl_module.table.detach().clone())


def bigram_logprobs(table, input_ids, prompt_length=2):
    log_dist = torch.log_softmax(table[input_ids[:, prompt_length - 1 : -1]], -1)
    return log_dist.gather(-1, input_ids[:, prompt_length:, None]).squeeze(-1)


def test_token_flip_fractions_of_a_constructed_update():
    flips, keep = TokenFlipMonitor(every_n_steps=1), KeepTable()
    # member 0 (A > 0) is reinforced, member 1 (A < 0) pushed down; their shared tokens cancel
    batch = group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])
    module = BigramPolicy([batch], lr=0.5)
    fit(module, [keep, flips], 1)
    # independent recomputation of delta from the table before and after the step
    delta = bigram_logprobs(module.table.detach(), batch["input_ids"]) - bigram_logprobs(keep.before[0], batch["input_ids"])
    shared = torch.tensor([[True, True, False, False]] * 2)
    assert delta[0, 2:].gt(0).all() and delta[1, 2:].lt(0).all()  # own tokens follow the advantage
    assert delta[shared].abs().max() < 1e-6  # shared tokens do not move
    assert flips.last["boosted_positive"] == pytest.approx(float((delta[0] > 0).float().mean()))
    assert flips.last["suppressed_negative"] == pytest.approx(float((delta[1] < 0).float().mean()))
    assert flips.last["boosted_specific"] == pytest.approx(0.5) and flips.last["suppressed_specific"] == pytest.approx(0.5)
    assert flips.last["boosted_shared"] == 0.0 and flips.last["suppressed_shared"] == 0.0
    assert flips.last["mean_abs_change"] == pytest.approx(float(delta.abs().mean()))
    assert flips.last["mean_abs_change_shared"] < 1e-6
    assert flips.last["mean_abs_change_positive_specific"] == pytest.approx(float(delta[0, 2:].abs().mean()))
    assert flips.last["boosted_positive_specific"] == 1.0 and flips.last["suppressed_negative_specific"] == 1.0


def test_token_flip_bins_by_confidence_and_by_sign_of_the_rollouts_holding_the_token():
    flips, keep = TokenFlipMonitor(every_n_steps=1, confidence_bins=(0.05, 0.2)), KeepTable()
    # 5, 6 (shared) and 8 are in the positive and in the negative rollout: both signs; 7 and 9 one sign
    completions = [[5, 6, 7, 8], [5, 6, 9, 8]]
    batch = group_batch(NOT_EXCHANGEABLE, completions, [1.0, -1.0])
    table = torch.zeros(VOCAB, VOCAB)
    table[6, 7], table[3, 5] = 2.0, 4.0  # p(5 | 3) and p(7 | 6) above 0.2; the other tokens at 1/12-ish, in (0.05, 0.2)
    module = BigramPolicy([batch], lr=0.5)
    with torch.no_grad():
        module.table.copy_(table)
    fit(module, [keep, flips], 1)
    before = bigram_logprobs(keep.before[0], batch["input_ids"])
    delta = bigram_logprobs(module.table.detach(), batch["input_ids"]) - before
    probability = before.exp()
    confidence = torch.where(probability < 0.05, 0, torch.where(probability < 0.2, 1, 2))
    both = torch.tensor([[True, True, False, True], [True, True, False, True]])
    shared = torch.tensor([[True, True, False, False]] * 2)
    splits = {"shared": shared, "specific": ~shared, "both_signs": both, "one_sign": ~both}
    seen = 0
    for index, name in enumerate(["p0-0.05", "p0.05-0.2", "p0.2-1"]):
        for split, where in splits.items():
            where = where & (confidence == index)
            assert flips.last[f"tokens_{split}_{name}"] == int(where.sum())
            if where.any():
                seen += 1
                assert flips.last[f"mean_abs_change_{split}_{name}"] == pytest.approx(float(delta[where].abs().mean()), rel=1e-5)
                assert flips.last[f"boosted_{split}_{name}"] == pytest.approx(float((delta[where] > 0).float().mean()))
            else:
                assert f"mean_abs_change_{split}_{name}" not in flips.last
    assert seen >= 4 and int(confidence.eq(2).sum()) > 0 and int(confidence.eq(1).sum()) > 0


def test_token_flip_bins_are_validated():
    for bins in [(0.9, 0.5), (0.0, 0.5), (0.5, 1.0), (0.5, 0.5)]:
        with pytest.raises(ValueError, match="confidence_bins must be increasing values in \\(0, 1\\)"):
            TokenFlipMonitor(confidence_bins=bins)


def test_both_signs_by_hand():
    tokens = torch.tensor([[1, 2, 3], [1, 4, 5], [2, 9, 9], [7, 7, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    # group 0: the positive rollout holds 1, 2, 3; the negatives 1, 4, 5, 2, 9: 1 and 2 are in both; group 1 has no negative
    expected = [[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert token_flip.both_signs(tokens, mask, torch.tensor([0, 0, 0, 1]), torch.tensor([1.0, -1.0, -1.0, 1.0])).long().tolist() == expected


def test_gradient_accumulation_is_measured_per_optimizer_step():
    """Two micro-batches (two groups) per optimizer step: both passes cover both, across the one step."""
    flips, tax, keep = TokenFlipMonitor(every_n_steps=1), LearningTaxMonitor(kl_every_n_steps=1), KeepTable()
    first = group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0], group=0)
    second = group_batch(EXCHANGEABLE, [[5, 6, 2, 4], [5, 2, 4, 4]], [-1.0, 1.0], group=1)
    module = BigramPolicy([first, second], lr=0.5)
    fit(module, [keep, flips, tax], 1, accumulate_grad_batches=2)
    after, before = module.table.detach(), keep.before[0]
    deltas = [bigram_logprobs(after, b["input_ids"]) - bigram_logprobs(before, b["input_ids"]) for b in (first, second)]
    delta = torch.cat(deltas)
    assert flips.last["mean_abs_change"] == pytest.approx(float(delta.abs().mean()), rel=1e-5)
    positive = torch.cat([deltas[0][0], deltas[1][1]])
    assert flips.last["boosted_positive"] == pytest.approx(float((positive > 0).float().mean()))
    # shared contexts: token 3 (both groups), 5 (first group), KL of the table's rows across the step
    rows = torch.tensor([3, 5, 3])
    kl = (before[rows].softmax(-1) * (before[rows].log_softmax(-1) - after[rows].log_softmax(-1))).sum(-1)
    assert tax.last_shared_kl == pytest.approx(float(kl.mean()), rel=1e-5)
    # credits of both micro-batches: uncancelled 0.25 of 3.75 + 4.4
    assert tax.last_tax == pytest.approx(0.25 / (3.75 + 4.4))


def test_at_learning_rate_zero_every_change_is_zero_despite_dropout():
    probes = [{"prompt": [1, 3], "solutions": [[5, 6], [5, 7]]}]
    monitors = [TokenFlipMonitor(every_n_steps=1), LearningTaxMonitor(kl_every_n_steps=1),
                SolutionProbabilityDriftMonitor(probes=probes, every_n_steps=1)]
    module = BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 3, lr=0.0, dropout=0.5)
    module.table.data.normal_(generator=torch.Generator().manual_seed(0))
    fit(module, monitors, 3)
    flips, tax, drift = monitors
    assert flips.last["mean_abs_change"] == 0.0
    assert all(flips.last[f"{kind}_{split}"] == 0.0 for kind in ("boosted", "suppressed") for split in ("positive", "negative"))
    assert tax.last_shared_kl == 0.0
    assert drift.last["logprob_change"] == 0.0
    # every extra pass ran without grad and with dropout off
    assert module.seen and all(seen[:2] == (False, False) for seen in module.seen)


def test_extra_passes_run_in_the_trainers_precision_context():
    module = BigramPolicy([group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 2, dropout=0.1)
    fit(module, [TokenFlipMonitor(every_n_steps=1), LearningTaxMonitor(kl_every_n_steps=1)], 2, precision="bf16-mixed")
    assert len(module.seen) == 8 and all(seen == (False, False, True) for seen in module.seen)


class SamplingPolicy(BigramPolicy):
    """The common layout: the batch holds prompts only; the training step samples the group and returns everything.

    Every completion opens with the template token 5, so each group shares the context 3 -> 5; two
    tokens are sampled after it. The reward is whether the second completion token is 6 or above;
    members' credits are weighted unequally (1, 1/2, 1/4, 1/8), which does not cancel.
    """

    group_size = 4
    template_token = 5

    def training_step(self, batch, batch_idx):
        prompts = batch["prompts"].repeat_interleave(self.group_size, 0)
        generator = torch.Generator().manual_seed(batch_idx)
        with torch.no_grad():
            tokens = [prompts, torch.full_like(prompts[:, :1], self.template_token)]
            for _ in range(2):
                tokens.append(torch.multinomial(self.table[tokens[-1][:, -1]].softmax(-1), 1, generator=generator))
            input_ids = torch.cat(tokens, 1)
        rewards = (input_ids[:, 3] >= 6).float().view(-1, self.group_size)
        advantages = (rewards - rewards.mean(1, keepdim=True)).view(-1)
        logprobs, log_dist = self._logprobs(input_ids, 2)
        weights = torch.tensor([1.0, 0.5, 0.25, 0.125]).repeat(len(prompts) // self.group_size)
        credits = (advantages * weights / 3).unsqueeze(1).expand_as(logprobs)
        return {
            "loss": -(credits * logprobs).sum(), "credits": credits, "logprobs": logprobs.detach(),
            "entropy": -(log_dist.exp() * log_dist).sum(-1).detach(), "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids), "prompt_length": 2, "completion_mask": torch.ones_like(logprobs),
            "advantages": advantages, "group_ids": torch.arange(len(batch["prompts"])).repeat_interleave(self.group_size),
        }


class KeepOutputs(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs = outputs


def test_a_module_that_samples_inside_its_training_step():
    monitors = [EntropyCollapseMonitor(), LearningTaxMonitor(kl_every_n_steps=1), TokenFlipMonitor(every_n_steps=1)]
    keep, kept = KeepTable(), KeepOutputs()
    module = SamplingPolicy([{"prompts": torch.tensor([[1, 3], [2, 3]])}], lr=2.0)
    fit(module, [keep, kept, *monitors], 1)
    out, after, before = kept.outputs, module.table.detach(), keep.before[0]
    tokens, mask = out["input_ids"][:, 2:], out["completion_mask"]
    # independent values from the core's own copies of the tax and the shared positions
    assert monitors[1].last_tax == pytest.approx(learning_tax(out["credits"], tokens, mask, out["group_ids"])) and monitors[1].last_tax > 0
    contexts = out["input_ids"][:, 1:-1][shared_positions(tokens, mask, out["group_ids"])]  # groups of equal size
    kl = (before[contexts].softmax(-1) * (before[contexts].log_softmax(-1) - after[contexts].log_softmax(-1))).sum(-1)
    # the uniform context 3 moves by a KL of order lr^2 * net credit^2 / 12, far above float32 rounding (~1e-7 here)
    assert monitors[1].last_shared_kl == pytest.approx(float(kl.mean()), rel=1e-4) and monitors[1].last_shared_kl > 1e-4
    delta = bigram_logprobs(after, out["input_ids"]) - bigram_logprobs(before, out["input_ids"])
    assert monitors[2].last["mean_abs_change"] == pytest.approx(float(delta.abs().mean()), rel=1e-5)
    assert monitors[0].baseline is not None



def test_solution_drift_log_odds_and_preference_entropy_of_a_constructed_probe():
    # characters map to token ids by ord % 12: "a" -> 1, "x" -> 0, "y" -> 1, "z" -> 2; token ids work alike
    probes = [{"prompt": "a", "solutions": ["xy", "xz"]}, {"prompt": [1], "solutions": [[0]]}]
    monitor = SolutionProbabilityDriftMonitor(probes=probes, every_n_steps=1)
    module = BigramPolicy([group_batch([[0.0, 0.0, 0.0, 0.0]], [[0, 1, 0, 0]], [1.0])] * 2, lr=1.0)
    module.batches = [{**b, "input_ids": torch.tensor([[1, 1, 0, 1]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
                       "completion_mask": torch.tensor([[1, 1]]), "credits": torch.tensor([[0.0, 2.0]]), "prompt_length": 2}
                      for b in module.batches]
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

"""What every health callback promises in any Lightning project: sparse logging at its step, alerts that warn once
or stop (agreed across processes), one-line failures for a broken contract or bad arguments, no lit_cancel import."""

import ast
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lit_cancel.callbacks import EntropyCollapseMonitor, LearningTaxMonitor, SolutionProbabilityDriftMonitor, TokenFlipMonitor
from test_callbacks import CALLBACKS_DIR, COMPLETIONS, EXCHANGEABLE, NOT_EXCHANGEABLE, BigramPolicy, fit, group_batch
from torch import nn


class Recorder(Logger):
    """A Lightning logger that keeps every point it is given."""

    name, version = "recorder", 0

    def __init__(self):
        super().__init__()
        self.points: dict[str, list[int]] = {}

    def log_metrics(self, metrics, step=None):
        for name in metrics:
            self.points.setdefault(name, []).append(step)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_sparse_measurements_are_logged_once_each_at_their_step():
    probes = [{"prompt": [1, 3], "solutions": [[5, 6], [5, 7]]}]
    monitors = [TokenFlipMonitor(every_n_steps=5), LearningTaxMonitor(kl_every_n_steps=5),
                SolutionProbabilityDriftMonitor(probes=probes, every_n_steps=5), EntropyCollapseMonitor(log_every_n_steps=2)]
    recorder = Recorder()
    fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 20, lr=0.1), monitors, 20,
        logger=recorder, log_every_n_steps=1)
    for name in ["health/flip_mean_abs_change", "health/shared_kl", "health/drift_logprob_change"]:
        assert recorder.points[name] == [0, 5, 10, 15], name
    assert recorder.points["health/entropy_mean"] == list(range(0, 20, 2))
    assert recorder.points["health/learning_tax"] == list(range(20))


def test_an_alert_warns_once_when_the_value_crosses_its_threshold():
    monitor = EntropyCollapseMonitor(min_ratio=0.5)
    batches = [group_batch([[20.0] * 4, [20.0] * 4], COMPLETIONS, [1.0, 1.0])] * 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(BigramPolicy(batches), [monitor], 20)
    alerts = [w for w in caught if "EntropyCollapseMonitor at step" in str(w.message)]
    assert len(alerts) == 1 and len(monitor.alert_steps) == 1 and monitor.collapsed


def test_a_warn_and_a_stop_monitor_of_one_class_in_one_trainer():
    warn, stop = LearningTaxMonitor(max_tax=0.01), LearningTaxMonitor(max_tax=0.5, action="stop")
    trainer = fit(BigramPolicy([group_batch(NOT_EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 3), [warn, stop], 3)
    assert warn.state_key != stop.state_key
    assert warn.alert_steps == [0] and not stop.alert_steps and trainer.global_step == 3


def test_the_stop_decision_is_reduced_over_processes(monkeypatch):
    """Another process past the threshold stops this one too: the decision goes through the strategy."""
    monitor = LearningTaxMonitor(max_tax=0.5, action="stop", kl_every_n_steps=0)
    module = BigramPolicy([group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])] * 3)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    votes = []
    monkeypatch.setattr(trainer.strategy, "reduce_boolean_decision", lambda decision, all=True: votes.append(decision) or True)
    trainer.fit(module)
    assert votes == [False] and trainer.global_step == 1 and monitor.last_tax == 0.0


def with_batch(**changes):
    batch = group_batch(EXCHANGEABLE, COMPLETIONS, [1.0, -1.0])
    return [{**{k: v for k, v in batch.items() if k not in changes}, **{k: v for k, v in changes.items() if v is not None}}]


@pytest.mark.parametrize(
    ("make", "batches", "message"),
    [
        (lambda: TokenFlipMonitor(every_n_steps=1), with_batch(advantages=torch.tensor([[1.0], [-1.0]])),
         r"TokenFlipMonitor needs batch\['advantages'\] of shape \[B\] = \[2\], got \[2, 1\]"),
        (lambda: LearningTaxMonitor(kl_every_n_steps=0), with_batch(group_ids=None),
         r"LearningTaxMonitor needs 'group_ids' \(\[B\]\) in the training step's outputs or the batch; found in neither"),
        (lambda: LearningTaxMonitor(kl_every_n_steps=1), with_batch(attention_mask=torch.ones(2, 5, dtype=torch.long)),
         r"LearningTaxMonitor needs batch\['attention_mask'\] of shape \[B, P \+ C\] = \[2, 6\], got \[2, 5\]"),
        (lambda: LearningTaxMonitor(kl_every_n_steps=0), with_batch(group_ids=torch.zeros(2, 1, dtype=torch.long)),
         r"LearningTaxMonitor needs batch\['group_ids'\] of shape \[B\] = \[2\], got \[2, 1\]"),
    ],
)
def test_a_broken_contract_fails_with_one_line_naming_the_key_and_shapes(make, batches, message):
    with pytest.raises(ValueError, match=message):
        fit(BigramPolicy(batches), [make()], 1)


class NoExtraPasses(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)


@pytest.mark.parametrize(
    ("callback", "method"),
    [(TokenFlipMonitor(), "token_logprobs"), (LearningTaxMonitor(), "next_token_logprobs"),
     (SolutionProbabilityDriftMonitor(probes=[{"prompt": "a", "solutions": ["b"]}]), "sequence_logprobs")],
)
def test_a_missing_module_method_fails_in_setup(callback, method):
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[callback])
    with pytest.raises(TypeError, match=rf"needs NoExtraPasses.{method}\(.*it has none"):
        callback.setup(trainer, NoExtraPasses(), "fit")

@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EntropyCollapseMonitor(min_ratio=1.5), "min_ratio must be in"),
        (lambda: EntropyCollapseMonitor(action="explode"), "action must be 'warn' or 'stop'"),
        (lambda: LearningTaxMonitor(max_tax=0), "max_tax must be in"),
        (lambda: LearningTaxMonitor(kl_every_n_steps=-1), "kl_every_n_steps >= 0"),
        (lambda: TokenFlipMonitor(every_n_steps=0), "every_n_steps must be >= 1"),
        (lambda: SolutionProbabilityDriftMonitor(probes=[{"prompt": "a"}]), r"probes\[0\] must be a dict with a 'prompt'"),
        (lambda: SolutionProbabilityDriftMonitor(probes=[{"prompt": "a", "solutions": [[1, "b"]]}]), "string or a list of token ids"),
        (lambda: SolutionProbabilityDriftMonitor(min_entropy_ratio=0), "min_entropy_ratio must be in"),
        (lambda: SolutionProbabilityDriftMonitor(probes=[]), "probes is an empty list; give at least one probe"),
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

"""Episodes sampled ahead of the trainer (``max_staleness`` > 0): the producer runs a later draw's episodes in the
background, each turn sampled by the weights the engine holds then, and trains them at most ``max_staleness`` rounds
later, the environment's tokens out of the credit as in synchronous training."""

import copy
import threading
import time
from functools import partial

import lightning as L
import torch
from conftest import check_sampled_ahead

from lit_cancel import GRPO, RLModule, RolloutDataModule
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.agents.episodes import Episode, as_generation, episode_stats
from lit_cancel.engines import DecodeLoop, PolicyWeights, Sampled
from lit_cancel.logprobs import completion_logprobs
from lit_cancel.sharding import ModelRoot


class Snapshots(DecodeLoop):
    """Samples with the copy of the weights taken at the last sync, as a server samples with the version it was pushed,
    and reports each row's log-probs and step; keeps every version it held."""

    max_staleness = 1
    holds_weights = True
    can_sample_ahead = True

    def __init__(self):
        self.held: PolicyWeights | None = None
        self.versions: dict[int, torch.nn.Module] = {}
        self.changed = threading.Condition()
        self.calls: list[tuple[str, int, str]] = []  # (method, step of the weights used, thread)

    def sync(self, policy):
        model = copy.deepcopy(policy.model).eval()
        with self.changed:
            self.held = PolicyWeights(ModelRoot(model), policy.tokenizer, policy.step, policy.device)
            self.versions[policy.step] = model
            self.changed.notify_all()
        return 0.0

    def sample(self, policy, request):
        return self.sampled_with(self.held, request, "sample")

    def sample_ahead(self, request, oldest_step, first_seed):
        with self.changed:
            self.changed.wait_for(lambda: self.held is not None and self.held.step >= oldest_step)
            held = self.held
        return self.sampled_with(held, request, "sample_ahead")

    def sampled_with(self, held, request, method):
        self.calls.append((method, held.step, threading.current_thread().name))
        with torch.no_grad():
            sequences = super().sample(held, request).sequences
            mask = torch.cat([request.attention_mask.repeat_interleave(request.num_samples, 0),
                              torch.ones_like(sequences[:, request.input_ids.shape[1]:])], 1)
            logprobs, _ = completion_logprobs(held.model, sequences, mask, request.input_ids.shape[1])
        steps = torch.full((len(sequences),), held.step)
        return Sampled(sequences, logprobs, steps=steps)


class Rounds(L.Callback):
    def __init__(self):
        self.trained = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trained.append((trainer.global_step - 1, batch, outputs["credits"].detach()))


def test_an_agent_s_episodes_sampled_ahead_train_one_round_late_with_each_turn_s_weights_and_log_probs():
    torch.manual_seed(0)
    engine = Snapshots()
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, objective=GRPO(), engine=engine,
                      optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(ToolAdditionTask(num_digits=5, train_size=64, val_size=8), prompts_per_round=4, group_size=4, seed=1)
    rounds = Rounds()
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[rounds])
    trainer.fit(module, datamodule=data)
    calls_at_the_end = len(engine.calls)
    time.sleep(1.0)
    assert len(engine.calls) == calls_at_the_end, "the episodes sampled ahead stop when the fit ends"

    # the first draw is sampled on demand, turn by turn; every later one in the background, ahead of its round
    on_demand = [call for call in engine.calls if call[0] == "sample"]
    assert 1 < len(on_demand) <= 4 and all(step == 0 for _, step, _ in on_demand)
    ahead = [call for call in engine.calls if call[0] == "sample_ahead"]
    assert ahead and all(thread != threading.main_thread().name for _, _, thread in ahead)

    # each policy token carries its log-prob under a version the engine held between the row's step and this one
    stale = check_sampled_ahead([(step, batch) for step, batch, _ in rounds.trained], engine.versions)
    for _, batch, credits in rounds.trained:
        replies = batch.attention_mask[:, batch.prompt_length:].bool() & ~batch.completion_mask.bool()
        assert (credits[replies] == 0).all()
    assert stale >= 2, "rounds after the first train episodes sampled one round earlier"
    assert trainer.callback_metrics["rollout/staleness_max"] <= 1
    assert 0 <= trainer.callback_metrics["rollout/mixed_versions"] <= 1


def test_an_episode_whose_turns_two_versions_sampled_counts_as_mixed_and_as_sampled_by_the_older():
    episodes = [Episode([1, 2], None, "record 0", tokens=[5, 6], from_policy=[True, True], turn_steps=[3, 3]),
                Episode([1, 2], None, "record 1", tokens=[5, 7], from_policy=[True, True], turn_steps=[4, 3])]
    generation = as_generation(episodes, 0, torch.device("cpu"), [1.0, 0.0], 0.0, episode_stats(episodes))
    assert generation.sampler_steps.tolist() == [3, 3]
    assert generation.stats["rollout/mixed_versions"] == 0.5
    episodes[0].turn_steps = episodes[1].turn_steps = []  # an engine that samples with the current weights reports none
    assert "rollout/mixed_versions" not in episode_stats(episodes)
    assert as_generation(episodes, 0, torch.device("cpu"), [1.0, 0.0], 0.0, {}).sampler_steps is None

"""The rollout producer on its own: a round from a policy that is not a LightningModule, its advantages over whole
groups, and dynamic sampling's draws, against values computed by hand."""

from contextlib import nullcontext

import pytest
import torch

from lit_cancel import AdditionTask, DecodeLoop, PolicyGradient
from lit_cancel.engines import PolicyWeights, Sampled, SamplingOptions
from lit_cancel.hub import load_tokenizer
from lit_cancel.objectives.advantages import MeanCentred
from lit_cancel.rounds.producer import Processes, RolloutProducer
from lit_cancel.rounds.sample import Generation, encode_completions
from lit_cancel.sharding import ModelRoot


class ScriptedPolicy:
    """What the producer needs of a policy (``RolloutPolicy``), with each rollout's completions given as texts."""

    def __init__(self, scripts: list[list[str]]):
        self.tokenizer = load_tokenizer("embedded:tiny-adder")
        self.stop_token_ids = [self.tokenizer.eos_token_id]
        self.engine = DecodeLoop()  # the producer reads its max_staleness (0) alone
        self.device = torch.device("cpu")
        self.scripts, self.prompts = list(scripts), []
        self.root = ModelRoot(torch.nn.Linear(2, 2))
        self.objective = PolicyGradient(advantage=MeanCentred())

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(1.0, 1.0, 8, tuple(self.stop_token_ids), self.tokenizer.pad_token_id)

    def policy_weights(self) -> PolicyWeights:
        return PolicyWeights(self.root, self.tokenizer, 0, self.device)

    def precision_context(self):
        return nullcontext()

    def rollout(self, input_ids, attention_mask, num_samples=1, greedy=False) -> Generation:
        self.prompts.append(self.tokenizer.batch_decode(input_ids, skip_special_tokens=True))
        ids, _ = encode_completions(self.tokenizer, self.scripts.pop(0))
        sequences = torch.cat([input_ids.repeat_interleave(num_samples, 0), ids], 1)
        return Generation.from_sampled(Sampled(sequences), attention_mask, num_samples, self.tokenizer, 0.0, self.stop_token_ids)

    def score_rollouts(self, generation, with_old_logprobs):
        return None, None


ONE_PROCESS = Processes(rank=0, world=1, step=lambda: 0, sum=lambda tensor: tensor)


def producer(**kwargs) -> RolloutProducer:
    # a completion "1" earns 1, anything else 0
    task = AdditionTask(num_digits=2, train_size=16, val_size=4, reward_fn=lambda record, completion: float(completion == "1"))
    return RolloutProducer(task, seed=3, **kwargs)


def test_a_round_is_rewarded_and_advantaged_over_each_whole_group():
    policy = ScriptedPolicy([["1", "1", "0", "0", "1", "0", "0", "0"]])
    rounds = producer(prompts_per_round=2, group_size=4, steps_per_round=1)
    batch, stats = rounds.sample_round(policy, ONE_PROCESS, round_index=0)
    assert batch.rewards.tolist() == [1, 1, 0, 0, 1, 0, 0, 0]
    # each group's rewards minus the group's mean: 1/2 in the first, 1/4 in the second
    assert batch.advantages.tolist() == [0.5, 0.5, -0.5, -0.5, 0.75, -0.25, -0.25, -0.25]
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4
    assert stats["rollout/reward_mean"] == pytest.approx(3 / 8) and stats["rollout/frac_zero_std_groups"] == 0
    assert policy.prompts == [[record["prompt"] for record in rounds.draw_records(0, 0, 1)]] and rounds.prompt_draws == 1


def test_dynamic_sampling_draws_again_until_enough_groups_have_a_reward_difference_and_keeps_those_first():
    # draw 0: the first group all "1" (no signal), the second mixed; draw 1: the first group mixed, the second all "0"
    policy = ScriptedPolicy([["1", "1", "1", "0"], ["0", "1", "0", "0"], ["1", "0", "1", "0"]])
    rounds = producer(prompts_per_round=2, group_size=2, steps_per_round=1, dynamic_sampling=True, max_prompt_draws=3)
    batch, stats = rounds.sample_round(policy, ONE_PROCESS, round_index=0)
    assert rounds.prompt_draws == 2 and len(policy.scripts) == 1  # two informative groups after two draws: no third
    assert batch.rewards.tolist() == [1, 0, 0, 1] and batch.advantages.tolist() == [0.5, -0.5, -0.5, 0.5]
    first, second = rounds.draw_records(0, 0, 1), rounds.draw_records(1, 0, 1)
    prompts = policy.tokenizer.batch_decode(batch.input_ids[:, : batch.prompt_length], skip_special_tokens=True)
    assert prompts == [first[1]["prompt"]] * 2 + [second[0]["prompt"]] * 2


class OneCall(AdditionTask):
    """A rollout of its own that asks the policy once, as :class:`Task`'s does."""

    def rollout(self, policy, records, input_ids, attention_mask, num_samples=1, greedy=False):
        return policy.rollout(input_ids, attention_mask, num_samples, greedy)


class TwoCalls(AdditionTask):
    """A rollout that asks the policy twice (as an agent asks once a turn), not an ``AgentTask``."""

    rollout_in_one_call = False

    def rollout(self, policy, records, input_ids, attention_mask, num_samples=1, greedy=False):
        policy.rollout(input_ids, attention_mask, num_samples, greedy)
        return policy.rollout(input_ids, attention_mask, num_samples, greedy)


class AheadEngine(DecodeLoop):
    """Samples ahead, recording each call: a draw's single completions (``prefetch``), or a rollout's calls (``sample_ahead``)."""

    max_staleness, can_sample_ahead = 1, True

    def __init__(self):
        self.calls = []

    def prefetch(self, policy, request, seed, oldest_step):
        self.calls.append(("prefetch", oldest_step))

    def sample_ahead(self, request, oldest_step, first_seed):
        self.calls.append(("sample_ahead", oldest_step))
        completions = torch.full((len(request.input_ids) * request.num_samples, 1), request.options.stop_token_ids[0])
        return Sampled(torch.cat([request.input_ids.repeat_interleave(request.num_samples, 0), completions], 1))


@pytest.mark.parametrize(("task_class", "calls"), [(OneCall, ["prefetch"]), (TwoCalls, ["sample_ahead"] * 2)])
def test_a_draw_is_sampled_ahead_as_the_task_declares_its_rollout_whatever_its_class(task_class, calls):
    policy = ScriptedPolicy([])
    policy.engine = AheadEngine()
    rounds = RolloutProducer(task_class(num_digits=2, train_size=16, val_size=4), prompts_per_round=2, group_size=2,
                             steps_per_round=1, seed=3)
    rounds.prefetch(policy, ONE_PROCESS, draw=1, oldest_step=5)
    if rounds.ahead:
        assert rounds.ahead.pop(1).result().texts == [""] * 4
    assert policy.engine.calls == [(call, 5) for call in calls]


"""Multi-turn episodes: the environment's tokens are context (``attention_mask``) but get no credit (``completion_mask``),
so a prefix that a whole group shares runs on through an observation they share, and only the policy's tokens in it count."""

import pytest
import torch
from lit_cancel.callbacks import LearningTaxMonitor, TokenFlipMonitor, token_flip
from lit_cancel.callbacks import learning_tax as tax_callback
from test_callbacks import BigramPolicy, fit, shared_context_kl

from lit_cancel.objectives import audit

COPIES = [tax_callback.shared_positions, token_flip.shared_positions]

# group 0, three episodes: a first turn 5 6 7, the environment's 2 2, then second turns 8 9 / 8 4 4 / 8 1, all starting with 8;
# group 1: the observations differ (2 3 / 2 4), then the same 8; group 2: the token 2 is the policy's in one row and the
# environment's in the other; group 3 has one member
TOKENS = torch.tensor([
    [5, 6, 7, 2, 2, 8, 9, 0], [5, 6, 7, 2, 2, 8, 4, 4], [5, 6, 7, 2, 2, 8, 1, 0],
    [5, 6, 2, 3, 8, 0, 0, 0], [5, 6, 2, 4, 8, 0, 0, 0],
    [5, 6, 2, 8, 0, 0, 0, 0], [5, 6, 2, 8, 0, 0, 0, 0],
    [5, 6, 7, 2, 2, 8, 0, 0],
])
MASK = torch.tensor([
    [1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 1, 1, 0],
    [1, 1, 0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 1, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 1, 0, 0],
])
CONTEXT = (TOKENS != 0).long()  # attention_mask[:, P:]: 1 on every token of the episode, 0 on padding
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])


@pytest.mark.parametrize("shared_positions", COPIES, ids=["learning_tax", "token_flip"])
def test_a_shared_first_turn_and_observation_share_the_prefix_on_to_the_second_turns_first_token(shared_positions):
    shared = shared_positions(TOKENS, MASK, GROUPS, CONTEXT)
    assert shared.long().tolist() == [
        [1, 1, 1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 1, 0, 0],  # through 2 2, to the shared 8
        [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0],  # the observations differ: the 8 after them is not shared
        [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0],  # the same 2, from the policy in one row only: not shared
        [0] * 8,
    ]
    assert not (shared & (CONTEXT.bool() & ~MASK.bool())).any()  # the environment's tokens are never marked


@pytest.mark.parametrize("shared_positions", COPIES, ids=["learning_tax", "token_flip"])
def test_without_a_context_the_prefix_is_the_policys_tokens_up_to_the_first_hole(shared_positions):
    expected = [[1, 1, 1, 0, 0, 0, 0, 0]] * 3 + [[1, 1, 0, 0, 0, 0, 0, 0]] * 4 + [[0] * 8]
    assert shared_positions(TOKENS, MASK, GROUPS).long().tolist() == expected
    # single-turn rollouts: the completion mask is the context, and the shared prefix is the one it always was
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 1], [4, 4, 4, 4], [4, 4, 4, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    expected = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert shared_positions(tokens, mask, groups).long().tolist() == expected
    assert shared_positions(tokens, mask, groups, mask).long().tolist() == expected


@pytest.mark.parametrize("shared_positions", [*COPIES, audit.shared_positions], ids=["learning_tax", "token_flip", "audit"])
def test_a_group_whose_episodes_opened_with_different_prompts_shares_nothing(shared_positions):
    """An environment whose opening text differs per episode: the same turns follow different contexts."""
    prompts = torch.tensor([[0, 1, 3]] * 8)
    prompts[1] = torch.tensor([1, 3, 4])  # group 0's second episode opened with one more token
    shared = shared_positions(TOKENS, MASK, GROUPS, CONTEXT, prompts)
    assert not shared[:3].any()
    assert torch.equal(shared[3:], shared_positions(TOKENS, MASK, GROUPS, CONTEXT)[3:])
    assert torch.equal(shared_positions(TOKENS, MASK, GROUPS, CONTEXT, torch.ones(8, 3, dtype=torch.long)),
                       shared_positions(TOKENS, MASK, GROUPS, CONTEXT))


def episode_group(credits: list[list[float]]) -> dict:
    """One group of two episodes after the prompt [1, 3]: a turn 5 6, the environment's 2 2, a second turn 7 8 / 7 10."""
    completions = torch.tensor([[5, 6, 2, 2, 7, 8], [5, 6, 2, 2, 7, 10]])
    input_ids = torch.cat([torch.tensor([[1, 3]] * 2), completions], 1)
    return {
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "prompt_length": 2,
        "completion_mask": torch.tensor([[1, 1, 0, 0, 1, 1]] * 2), "credits": torch.tensor(credits),
        "advantages": torch.tensor([1.0, -1.0]), "group_ids": torch.zeros(2, dtype=torch.long),
    }


def test_learning_tax_and_shared_kl_count_the_second_turns_shared_first_token():
    monitor = LearningTaxMonitor(kl_every_n_steps=1)
    fit(BigramPolicy([episode_group([[0.5, 0.5, 0.0, 0.0, 1.0, 0.2], [-0.5, -0.25, 0.0, 0.0, -0.5, -0.2]])]), [monitor], 1)
    # shared 5, 6 and, after the observation, 7: |0.5 - 0.5| + |0.5 - 0.25| + |1.0 - 0.5| = 0.75 of |c| summed = 3.65
    # (without the observation as context, 7 would not count: 0.25 / 3.65)
    assert monitor.last_tax == pytest.approx(0.75 / 3.65)
    # the shared contexts: after 3 (net credit 0), after 5 (0.25 on 6) and after the observation's last 2 (0.5 on 7)
    assert monitor.last_shared_kl == pytest.approx((shared_context_kl(0.25) + shared_context_kl(0.5)) / 3, rel=1e-5)


def test_learning_tax_is_zero_where_the_episodes_prompts_differ():
    monitor = LearningTaxMonitor()
    group = episode_group([[0.5, 0.5, 0.0, 0.0, 1.0, 0.2], [-0.5, -0.25, 0.0, 0.0, -0.5, -0.2]])
    group["input_ids"][1, 1] = 4  # the second episode's opening differs: its turns follow another context
    fit(BigramPolicy([group]), [monitor], 1)
    assert monitor.last_tax == 0.0


def test_token_flip_counts_the_second_turns_shared_first_token_as_shared():
    flips = TokenFlipMonitor(every_n_steps=1)
    fit(BigramPolicy([episode_group([[0.5, 0.5, 0.0, 0.0, 1.0, 0.2], [-0.5, -0.5, 0.0, 0.0, -1.0, -0.2]])], lr=0.5), [flips], 1)
    # a uniform table: every token at p = 1/12; shared: 5, 6 and 7 in both rows; the environment's 2 2 in neither split
    assert flips.last["tokens_shared_p0-0.5"] == 6 and flips.last["tokens_specific_p0-0.5"] == 2
    assert flips.last["mean_abs_change_shared"] < 1e-6  # exchangeable credits: the shared tokens do not move

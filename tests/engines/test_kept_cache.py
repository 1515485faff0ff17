"""The decode loop's KV cache kept across an agent's turns: the same tokens and distributions as prefilling every context
again, rows matched by their tokens (episodes that ended are gone, a new row matches none), and the cache dropped when
the weights change or the series of calls ends."""

import dataclasses

import pytest
import torch

from lit_cancel import RLModule
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.engines import DecodeLoop, SampleRequest
from lit_cancel.engines.decode_loop import logits_processors, sample_completions
from lit_cancel.engines.kept_cache import KeptCache
from lit_cancel.logprobs import position_ids_from_mask
from lit_cancel.rounds.sample import encode_prompts, padded


class Turns(DecodeLoop):
    """The decode loop, recording each call's rows and statistics; with ``forget`` it prefills every call whole."""

    def __init__(self, forget: bool = False):
        self.forget, self.calls = forget, []

    def sample(self, policy, request):
        sampled = super().sample(policy, dataclasses.replace(request, keep=request.keep and not self.forget))
        self.calls.append((len(request.input_ids), sampled.stats))
        return sampled


class Recorder:
    """A logits processor that keeps each step's rows so far and log-probabilities."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append((input_ids.clone(), torch.log_softmax(scores, -1)))
        return scores


@pytest.fixture(scope="module")
def agent():
    return RLModule("embedded:tiny-agent", max_new_tokens=23).eval()


def episodes(engine, greedy, seed=0):
    """Episodes of 3- and 5-digit problems, alternating: the tiny agent calls the tool for both, and some of its calls
    for the first run past the turn's token limit, which ends their episodes after the first turn."""
    task = ToolAdditionTask(num_digits=5, train_size=64, val_size=8)
    short = ToolAdditionTask(num_digits=3, train_size=64, val_size=8).train_records()[:6]
    records = [record for pair in zip(short, task.train_records()[:6]) for record in pair]
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, engine=engine).eval()
    encoded = encode_prompts(module.tokenizer, records)
    torch.manual_seed(seed)
    return task.rollout(module, records, encoded["input_ids"], encoded["attention_mask"], num_samples=4, greedy=greedy)


def test_greedy_episodes_with_the_kept_cache_are_token_for_token_those_prefilled_whole_each_turn():
    kept, whole = Turns(), Turns(forget=True)
    with_cache, without = episodes(kept, greedy=True), episodes(whole, greedy=True)
    assert torch.equal(with_cache.input_ids, without.input_ids) and with_cache.texts == without.texts
    assert torch.equal(with_cache.completion_mask, without.completion_mask)
    rows = [count for count, _ in kept.calls]
    assert rows == [count for count, _ in whole.calls]
    assert len(rows) >= 2 and rows[0] > rows[-1] > 0  # episodes that end leave the next turn's call
    first, second = [stats for _, stats in kept.calls[:2]]
    assert first["perf/kv_reused_tokens"] == 0
    # at the second turn each continuing episode reuses its prompt and first turn, the turn's stop token included unless
    # the loop sampled it at its last step and never wrote it
    prompts = with_cache.attention_mask[:, : with_cache.prompt_length].sum(1)
    policy = with_cache.completion_mask.bool()  # the policy's tokens after the prompt
    first_turn = policy.long().cumprod(1).sum(1)
    continued = (policy & ~policy.long().cumprod(1).bool()).any(1)  # a second turn of the policy
    assert continued.sum() == rows[1]
    upper = int((prompts + first_turn)[continued].sum())
    assert upper - rows[1] <= second["perf/kv_reused_tokens"] <= upper
    assert second["perf/prefill_tokens"] + second["perf/kv_reused_tokens"] == upper + tool_reply_tokens(with_cache, continued)
    assert all(stats == {} for _, stats in whole.calls)


def tool_reply_tokens(generation, rows):
    """Tokens of the environment's first reply in ``rows``: between the policy's first and second turns."""
    attended = generation.attention_mask[:, generation.prompt_length:].bool()
    policy = generation.completion_mask.bool()
    after_first = ~policy.long().cumprod(1).bool()
    before_second = ~(policy & after_first).long().cumsum(1).bool()
    return int((attended & ~policy & after_first & before_second)[rows].sum())


def test_sampled_episodes_with_the_kept_cache_match_those_prefilled_whole_each_turn():
    with_cache, without = episodes(Turns(), greedy=False, seed=3), episodes(Turns(forget=True), greedy=False, seed=3)
    # the same draws from distributions equal up to rounding: the same tokens, unless a draw falls within rounding of a
    # boundary between two tokens (the distributions themselves are compared in the next test)
    assert (with_cache.input_ids == without.input_ids).float().mean() > 0.99


EOS = 1  # the embedded models' character tokenizer's; pad is 0


def turn_tokens(ids, mask, sequences, row, num_samples=1):
    """Row ``row``'s context and completion, up to its stop token."""
    prompt = row // num_samples
    completion = sequences[row, ids.shape[1]:].tolist()
    ended = completion[: completion.index(EOS) + 1] if EOS in completion else completion
    return ids[prompt][mask[prompt].bool()].tolist() + ended


def check_kept_rows(kept, ids, mask, sequences, num_samples):
    """``kept`` holds each row of the call: its tokens, a row's context and completion up to its stop token, less the
    last unless the loop wrote it (it samples a token, then writes it in the next step, unless the row leaves the batch
    or the call ends), and its keys and values at them."""
    rows = [turn_tokens(ids, mask, sequences, row, num_samples) for row in range(len(sequences))]
    got = sorted(row[row >= 0].tolist() for row in kept.tokens)
    assert len(got) == len(rows)
    for tokens in rows:
        assert tokens in got or tokens[:-1] in got
    assert all(part.shape[0] == len(rows) for part in kept.keys + kept.values)


def continue_rows(ids, mask, sequences, rows, suffixes):
    """The contexts of the next turn: row ``r``'s context and completion then its suffix, for each ``r`` in ``rows``
    (None: the suffix alone, a new row)."""
    contexts = [suffix if row is None else turn_tokens(ids, mask, sequences, row) + suffix for row, suffix in zip(rows, suffixes)]
    return padded(contexts, 0, left=True)


def two_turns(model, keep, greedy, recorder=None):
    """A first (greedy) call on four prompts, then one of two samples each on the rows of :data:`ROWS`, kept or not."""
    prompts = [[5, 7, 9, 4, 6], [7, 7, 8], [6, 5, 4, 3, 2, 9, 8], [9, 9]]
    ids, mask = padded(prompts, 0, left=True)
    kept = KeptCache(step=0) if keep else None
    first = sample_completions(model, ids, mask, 1, 9, [EOS], 0, logits_processors({}, 1.0, 1.0, greedy=True), greedy=True, kept=kept)
    if keep:
        check_kept_rows(kept, ids, mask, first, 1)
        # the kept rows that the continued rows start with
        expected_reuse = sum(int((row >= 0).sum()) for row in kept.tokens
                             for continued in ROWS if continued is not None and row[0] == prompts[continued][0])
    next_ids, next_mask = continue_rows(ids, mask, first, ROWS, SUFFIXES)
    processors = logits_processors({}, 1.0, 1.0, greedy=greedy)
    if recorder is not None:
        processors.append(recorder)
    torch.manual_seed(0)
    second = sample_completions(model, next_ids, next_mask, 2, 9, [EOS], 0, processors, greedy=greedy, kept=kept)
    return next_ids, next_mask, second, kept, expected_reuse if keep else None


# rows 3 and 1 of the first call continue (1 after 3; rows 0 and 2 ended), and a new row whose first token no kept row
# has; the four prompts start with different tokens
ROWS, SUFFIXES = [3, None, 1], [[8, 4, 4], [3, 5, 5, 5], [4]]


def test_rows_are_matched_by_their_tokens_a_new_row_is_prefilled_whole_and_greedy_tokens_are_unchanged(agent):
    model = agent.policy.model
    ids, mask, with_cache, kept, expected_reuse = two_turns(model, True, True)
    ids_again, _, without, _, _ = two_turns(model, False, True)
    assert torch.equal(ids, ids_again) and torch.equal(with_cache, without)
    # each continued row reuses all its first-call row kept; the new row nothing
    assert kept.reused_tokens == expected_reuse > 0
    check_kept_rows(kept, ids, mask, with_cache, 2)


def test_a_call_of_one_token_a_row_keeps_its_contexts_and_the_next_call_continues_them(agent):
    model = agent.policy.model
    ids, mask = padded([[5, 7, 9, 4, 6], [7, 7, 8]], 0, left=True)
    kept = KeptCache(step=0)
    greedy = logits_processors({}, 1.0, 1.0, greedy=True)
    first = sample_completions(model, ids, mask, 1, 1, [EOS], 0, greedy, greedy=True, kept=kept)
    # the loop sampled one token a row and wrote none
    assert sorted(row[row >= 0].tolist() for row in kept.tokens) == [[5, 7, 9, 4, 6], [7, 7, 8]]
    next_ids, next_mask = padded([turn_tokens(ids, mask, first, row) + [4] for row in (1, 0)], 0, left=True)
    second = sample_completions(model, next_ids, next_mask, 1, 5, [EOS], 0, greedy, greedy=True, kept=kept)
    assert kept.reused_tokens == 3 + 5
    assert torch.equal(second, sample_completions(model, next_ids, next_mask, 1, 5, [EOS], 0, greedy, greedy=True))


def test_each_step_with_the_kept_cache_gives_the_distribution_of_a_full_forward_pass(agent):
    """Sampled log-probs: every step's distribution, from the reused keys, the new tokens' prefill and the decode steps,
    is the one a forward pass over the whole sequence gives at that position."""
    model = agent.policy.model
    recorder = Recorder()
    ids, mask, sequences, kept, _ = two_turns(model, True, False, recorder)
    assert kept.reused_tokens > 0
    full_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(sequences[:, ids.shape[1]:])], 1)
    with torch.no_grad():
        fresh = torch.log_softmax(model(input_ids=sequences, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)).logits, -1)
    checked = 0
    for so_far, logprobs in recorder.steps:
        for rows_so_far, step_logprobs in zip(so_far, logprobs):
            row = next(r for r in range(len(sequences)) if torch.equal(sequences[r, : so_far.shape[1]], rows_so_far))
            torch.testing.assert_close(step_logprobs, fresh[row, so_far.shape[1] - 1], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= len(sequences) * 2


def test_the_cache_is_dropped_when_the_weights_change_when_released_and_at_a_call_without_keep():
    engine = Turns()
    module = RLModule("embedded:tiny-agent", max_new_tokens=6, engine=engine).eval()
    prompt = module.tokenizer(["12345+67890=", "5+5="], return_tensors="pt", padding=True)
    ids, mask = prompt["input_ids"], prompt["attention_mask"]

    def twice(between):
        """The reused tokens of a call continuing the last one's rows, after ``between()``."""
        first = module.rollout(ids, mask, 1, True, keep_engine=True)
        between()
        turns = [row[attended.bool()].tolist() for row, attended in zip(first.input_ids, first.attention_mask)]
        module.rollout(*padded(turns, module.tokenizer.pad_token_id, left=True), 1, True, keep_engine=True)
        return engine.calls[-1][1]["perf/kv_reused_tokens"]

    prompt_tokens = int(mask.sum())
    assert twice(lambda: None) >= prompt_tokens  # the same weights: the prompts and most of the turns come from the cache

    def optimizer_step():
        module.weights_version += 1  # what RLModule.optimizer_step counts, after which the next rollout syncs the engine

    assert twice(optimizer_step) == 0
    assert twice(engine.release) == 0
    assert twice(lambda: module.rollout(ids, mask, 1, True)) == 0
    step = module.policy_weights().step
    module.rollout(ids, mask, 1, True, keep_engine=True)
    # a policy whose optimizer step differs from the cache's, without a sync (an engine that holds no weights)
    later = dataclasses.replace(module.policy_weights(), step=step + 1)
    request = SampleRequest(ids, mask, 1, module.sampling_options(), greedy=True, keep=True)
    assert engine.sample(later, request).stats["perf/kv_reused_tokens"] == 0
    assert engine.kept.step == step + 1

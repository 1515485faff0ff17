"""Episodes as one token sequence: turns kept as sampled and observations appended as ids (never re-tokenized), the
policy mask beside the attention mask, the limits, the environment's reward, and the training view of an episode
agreeing with what was sampled."""

import math
import random
import threading

import pytest
import torch

from lit_cancel import RLModule
from lit_cancel.agents import (
    AgentTask,
    ColonCalls,
    Environment,
    EnvironmentTask,
    Observation,
    ToolAdditionTask,
    ToolEnvironment,
    calculate,
    run_episodes,
)
from lit_cancel.agents.episodes import EpisodeLimits
from lit_cancel.engines import Sampled
from lit_cancel.hub import load_tokenizer
from lit_cancel.rounds.draw import record_names
from lit_cancel.rounds.failures import Failure
from lit_cancel.rounds.sample import Generation, encode_prompts
from lit_cancel.sft import SFTDataModule
from lit_cancel.tasks import AdditionTask, MathWordTask


class ScriptedPolicy:
    """A policy whose turn is ``script(context text)``, closed by EOS unless the script says not to; it records every
    context it was asked to continue, as token ids, and each call's ``keep_engine`` and each release of the engine."""

    def __init__(self, script, max_new_tokens: int = 8):
        self.tokenizer = load_tokenizer("embedded:tiny-adder")
        self.stop_token_ids = [self.tokenizer.eos_token_id]
        self.script, self.max_new_tokens, self.contexts, self.engine_calls = script, max_new_tokens, [], []

    def sampling_options(self):
        return type("Options", (), {"max_new_tokens": self.max_new_tokens})()

    def release_engine(self):
        self.engine_calls.append("release")

    def rollout(self, input_ids, attention_mask, num_samples=1, greedy=False, max_new_tokens=None, keep_engine=False):
        self.engine_calls.append("kept call" if keep_engine else "call")
        limit = max_new_tokens or self.max_new_tokens
        pieces = []
        for ids, mask in zip(input_ids, attention_mask):
            context = ids[mask.bool()].tolist()
            self.contexts.append(context)
            text, closed = self.script(self.tokenizer.decode(context))
            turn = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] * closed
            pieces.append(turn[:limit] + [self.tokenizer.pad_token_id] * (limit - len(turn[:limit])))
        sequences = torch.cat([input_ids, torch.tensor(pieces)], 1)
        return Generation.from_sampled(Sampled(sequences), attention_mask, 1, self.tokenizer, 0.0, self.stop_token_ids)


class Countdown(Environment):
    """Replies ``" left N\\n"`` after each turn, done after the turn that says ``stop``; the reward is the turns taken."""

    def reset(self, record):
        self.turns, self.seen = 0, []
        return record.get("opening")

    def step(self, action):
        self.turns += 1
        self.seen.append(action)
        return Observation("", done=True) if action == "stop" else Observation(f" left {3 - self.turns}\n")

    def reward(self):
        return float(self.turns)


def encoded(tokenizer, records):
    prompts = encode_prompts(tokenizer, records)
    return prompts["input_ids"], prompts["attention_mask"]


LIMITS = EpisodeLimits(max_turns=4, max_episode_tokens=64)


def run(policy, records, limits=LIMITS, environment=Countdown, num_samples=1):
    environments = []

    def make():
        environments.append(environment())
        return environments[-1]

    generation = run_episodes(policy, make, limits, records, *encoded(policy.tokenizer, records), num_samples)
    return generation, environments


def test_an_episode_is_its_turns_as_sampled_and_its_observations_as_ids_with_the_policy_mask_on_the_turns_only():
    replies = iter(["ab", "cd", "stop"])
    policy = ScriptedPolicy(lambda context: (next(replies), True))
    generation, (environment,) = run(policy, [{"prompt": "go:"}])
    tokenizer, eos = policy.tokenizer, policy.tokenizer.eos_token_id
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = ids("ab") + [eos] + ids(" left 2\n") + ids("cd") + [eos] + ids(" left 1\n") + ids("stop") + [eos]
    from_policy = [1] * 3 + [0] * len(ids(" left 2\n")) + [1] * 3 + [0] * len(ids(" left 1\n")) + [1] * 5
    assert generation.input_ids[0, generation.prompt_length:].tolist() == expected
    assert generation.completion_mask[0].tolist() == from_policy
    assert generation.attention_mask[0].tolist() == [1] * (generation.prompt_length + len(expected))
    # the environment read each turn without its stop token; every turn continued the episode's own ids
    assert environment.seen == ["ab", "cd", "stop"]
    assert policy.contexts[1] == ids("go:") + expected[: 3 + len(ids(" left 2\n"))]
    assert policy.contexts[2] == ids("go:") + expected[: len(expected) - 5]
    assert generation.texts == ["ab left 2\ncd left 1\nstop"]
    assert generation.rewards.tolist() == [3.0]
    stats = generation.stats
    assert stats["rollout/turns"] == 3 and stats["rollout/frac_truncated"] == 0 and stats["rollout/frac_turn_limit"] == 0
    assert stats["rollout/env_token_share"] == pytest.approx(2 * len(ids(" left 2\n")) / len(expected))


def test_rows_of_unequal_length_are_padded_after_their_episode_and_the_reset_text_joins_the_prompt():
    policy = ScriptedPolicy(lambda context: ("stop" if "x" in context or "now" in context else "x", True))
    records = [{"prompt": "a:"}, {"prompt": "long prompt:", "opening": "now "}]
    generation, _ = run(policy, records)
    tokenizer, eos = policy.tokenizer, policy.tokenizer.eos_token_id
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, second = (generation.input_ids[row][generation.attention_mask[row].bool()].tolist() for row in range(2))
    assert first == ids("a:x") + [eos] + ids(" left 2\n") + ids("stop") + [eos]
    assert second == ids("long prompt:now stop") + [eos]
    assert generation.prompt_length == len(ids("long prompt:now "))
    assert generation.completion_mask[1].tolist() == [1] * 5 + [0] * (generation.completion_mask.shape[1] - 5)
    assert generation.rewards.tolist() == [2.0, 1.0]
    assert generation.stats["rollout/turns"] == 1.5
    # the engine may keep its state (vLLM awake, its weights pushed) from turn to turn, and releases it after the last
    assert policy.engine_calls == ["kept call", "kept call", "release"]


def test_limits_end_an_episode_at_its_turn_limit_a_turn_cut_at_its_token_limit_and_the_episode_token_limit():
    forever = ScriptedPolicy(lambda context: ("go", True))
    generation, (environment,) = run(forever, [{"prompt": "p:"}], EpisodeLimits(max_turns=2, max_episode_tokens=64))
    # the last turn is read by the environment, but its observation is not appended: no turn follows it
    assert environment.seen == ["go", "go"] and generation.texts == ["go left 2\ngo"]
    assert generation.stats["rollout/frac_turn_limit"] == 1.0 and generation.stats["rollout/frac_truncated"] == 0

    rambling = ScriptedPolicy(lambda context: ("abcdefgh", False))
    generation, (environment,) = run(rambling, [{"prompt": "p:"}], EpisodeLimits(max_turns=3, max_turn_tokens=4))
    assert environment.seen == [] and generation.completion_mask.sum().item() == 4
    assert generation.stats["rollout/frac_turn_cut"] == 1.0 and generation.stats["rollout/frac_truncated"] == 1.0

    generation, _ = run(forever, [{"prompt": "p:"}], EpisodeLimits(max_turns=9, max_episode_tokens=12))
    assert generation.attention_mask[0, generation.prompt_length:].sum().item() == 12
    assert generation.stats["rollout/frac_episode_cut"] == 1.0 and generation.stats["rollout/frac_truncated"] == 1.0


def test_an_environment_without_a_reward_leaves_the_episode_to_the_task_and_one_that_raises_fails_its_episode():
    class Silent(Countdown):
        def reward(self):
            return None

    policy = ScriptedPolicy(lambda context: ("stop", True))
    generation, _ = run(policy, [{"prompt": "p:"}], environment=Silent)
    assert math.isnan(generation.rewards.item()) and generation.failures == [None]

    class Unscored(Countdown):
        def reward(self):
            raise KeyError("score")

    generation, _ = run(ScriptedPolicy(lambda context: ("stop", True)), [{"prompt": "p:"}], environment=Unscored)
    assert generation.failures == [Failure("reward_raised", "Unscored.reward raised on record 0: KeyError: 'score'")]
    # its row is inert: no policy token to credit, a reward of 0 that no task is asked for
    assert generation.completion_mask.sum() == 0 and generation.rewards.tolist() == [0.0]


def test_messages_name_a_record_by_its_split_its_index_and_where_the_task_read_it(gsm8k_file):
    class Secretive(Countdown):
        def reset(self, record):
            return record["secret"]

    math = MathWordTask(gsm8k_file, val_size=2)
    names = record_names(math, "val", [1])
    assert names == [f"val record 1 ({math.record_source('val', 1)})"] and gsm8k_file in names[0]
    assert record_names(AdditionTask(num_digits=1, train_size=4, val_size=2), "train", [3, 0]) == ["train record 3", "train record 0"]
    policy = ScriptedPolicy(lambda context: ("stop", True))
    records = math.val_records()[1:]
    task = EnvironmentTask(math, environment=Secretive)
    generation = task.rollout(policy, records, *encoded(policy.tokenizer, records), names=names)
    assert generation.failures == [Failure("reset_raised", f"Secretive.reset raised on {names[0]}: KeyError: 'secret'")]


class FailsOn(Countdown):
    """A countdown that fails as ``how`` says on the record whose prompt is ``"bad:"``, and runs on any other."""

    how = "step raises"

    def reset(self, record):
        self.bad = record["prompt"] == "bad:"
        if self.bad and self.how == "reset raises":
            raise KeyError("secret")
        if self.bad and self.how == "reset returns a number":
            return 7
        return super().reset(record)

    def step(self, action):
        if self.bad and self.turns == 1 and self.how == "step raises":
            raise ZeroDivisionError("division by zero")
        if self.bad and self.how == "step returns text":
            return "no observation"
        if self.bad and self.how == "step hangs":
            threading.Event().wait()
        return super().step(action)

    def reward(self):
        if self.bad and self.how == "reward is text":
            return "1.0"
        return super().reward()


@pytest.mark.parametrize(("how", "cause", "message"), [
    ("reset raises", "reset_raised", "FailsOn.reset raised on record 1: KeyError: 'secret'"),
    ("reset returns a number", "reset_wrong_type", "FailsOn.reset returned int on record 1; it must return text or None"),
    ("step raises", "step_raised", "FailsOn.step raised at turn 2 of record 1: ZeroDivisionError: division by zero"),
    ("step returns text", "step_wrong_type", "FailsOn.step returned str at turn 1 of record 1; it must return an Observation"),
    ("reward is text", "reward_wrong_type", "FailsOn.reward returned '1.0' (str), expected a finite number, on record 1"),
    ("step hangs", "timeout", "FailsOn.step did not answer at turn 1 of record 1 within episode_timeout=0.5 s (all of an "
                              "episode's environment calls)"),
])
def test_an_episode_whose_environment_fails_is_marked_with_its_cause_and_the_others_run_on(monkeypatch, how, cause, message):
    monkeypatch.setattr(FailsOn, "how", how)
    turns = iter(["go", "stop"] * 4)
    policy = ScriptedPolicy(lambda context: (next(turns) if "bad:" in context else "stop", True))
    limits = EpisodeLimits(max_turns=4, max_episode_tokens=64, episode_timeout=0.5 if how == "step hangs" else None)
    generation, _ = run(policy, [{"prompt": "good:"}, {"prompt": "bad:"}, {"prompt": "fine:"}], limits, environment=FailsOn)
    assert generation.failures == [None, Failure(cause, message), None]
    # the failed row keeps what it sampled in its context, but has no policy token to credit and a reward no task is asked for
    assert generation.completion_mask[1].sum() == 0 and generation.rewards[1] == 0
    assert (generation.completion_mask[[0, 2]].sum(1) > 0).all() and generation.rewards[[0, 2]].tolist() == [1.0, 1.0]


def test_a_factory_that_raises_mid_run_fails_its_episode_and_an_episode_timeout_must_be_positive():
    made = []

    def flaky() -> Environment:
        made.append(True)
        if len(made) == 2:
            raise OSError("sandbox unreachable")
        return Countdown()

    policy = ScriptedPolicy(lambda context: ("stop", True))
    records = [{"prompt": "a:"}, {"prompt": "b:"}]
    generation = run_episodes(policy, flaky, LIMITS, records, *encoded(policy.tokenizer, records), names=["train record 4", "train record 9"])
    assert generation.failures == [None, Failure("factory_raised", "the environment factory flaky raised for train record 9: "
                                                                   "OSError: sandbox unreachable")]
    with pytest.raises(ValueError, match="episode_timeout must be > 0 seconds or None, got 0"):
        EpisodeLimits(episode_timeout=0)


def test_a_round_counts_tool_outputs_cut_or_not_utf8_apart_from_failed_calls():
    def lookup(key: str) -> bytes:
        """Looks a key up.

        Args:
            key: what to look up.
        """
        return {"short": b"ok", "long": b"x" * 50, "binary": b"\xff"}[key]

    policy = ScriptedPolicy(lambda context: ("done" if "lookup" in context else f"lookup: {context.rstrip(':')}", True),
                            max_new_tokens=20)
    records = [{"prompt": f"{key}:"} for key in ("short", "long", "binary", "missing")]
    generation, _ = run(policy, records, environment=lambda: ToolEnvironment([lookup], ColonCalls("key"), max_output_chars=10))
    assert generation.texts[1] == "lookup:long = xxxxxxxxxx... [40 more characters cut]\ndone"
    # per episode: each of the 4 calls once; "missing" raised (an error); "long" was cut and "binary" is not UTF-8
    stats = generation.stats
    assert (stats["rollout/tool_calls"], stats["rollout/tool_errors"], stats["rollout/tool_output_faults"]) == (1.0, 0.25, 0.5)


def test_a_trl_environment_runs_its_tools_in_episodes_and_scores_them_with_get_reward():
    class Calculator:
        def reset(self, **row):
            self.answer, self.used = row["answer"], 0
            return None

        def add(self, a: int, b: int) -> int:
            """Adds two integers.

            Args:
                a: the first term.
                b: the second term.
            """
            self.used += 1
            return a + b

        def get_reward(self) -> float:
            return float(self.used > 0)

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    policy = ScriptedPolicy(lambda context: ("5" if "tool_response" in context else call, True), max_new_tokens=80)
    task = EnvironmentTask(AdditionTask(num_digits=1, train_size=4, val_size=2), trl_environment=Calculator, max_turns=3,
                           max_episode_tokens=400)
    records = [{"prompt": "2+3=", "answer": "5"}]
    generation = task.rollout(policy, records, *encoded(policy.tokenizer, records), num_samples=2)
    assert generation.rewards.tolist() == [1.0, 1.0]
    assert "<tool_response>\n5\n</tool_response>" in generation.texts[0]
    assert generation.stats["rollout/tool_calls"] == 1.0 and generation.stats["rollout/tool_errors"] == 0.0


def test_a_trl_environment_reads_its_calls_in_the_call_format_given():
    class Calculator:
        def reset(self, **row):
            return None

        def calculate(self, expression: str) -> str:
            """Evaluates an arithmetic expression.

            Args:
                expression: the expression.
            """
            return calculate(expression)

    policy = ScriptedPolicy(lambda context: ("5" if "<eos>" in context else "calculate: 2+3", True), max_new_tokens=20)
    task = EnvironmentTask(AdditionTask(num_digits=1, train_size=4, val_size=2), trl_environment=Calculator,
                           call_format=ColonCalls(), max_turns=3)
    records = [{"prompt": "2+3=", "answer": "5"}]
    generation = task.rollout(policy, records, *encoded(policy.tokenizer, records))
    assert generation.texts == ["calculate:2+3 = 5\n5"]  # the tiny tokenizer drops spaces from the turn it decodes
    assert generation.stats["rollout/tool_calls"] == 1.0 and generation.stats["rollout/tool_errors"] == 0.0


def test_a_call_format_is_refused_for_an_environment_of_your_own_and_when_it_is_not_a_call_format():
    task = AdditionTask(num_digits=1, train_size=4, val_size=2)
    with pytest.raises(ValueError, match="call_format applies to a trl_environment"):
        EnvironmentTask(task, environment=Countdown, call_format=ColonCalls())
    with pytest.raises(ValueError, match="call_format must be a CallFormat .* got 'colon'"):
        EnvironmentTask(task, trl_environment=dict, call_format="colon")


def test_a_tool_timeout_is_refused_for_an_environment_of_your_own_and_reaches_a_trl_environments_tools():
    class Calculator:
        def reset(self, **row):
            return None

        def calculate(self, expression: str) -> str:
            """Evaluates an arithmetic expression.

            Args:
                expression: the expression.
            """
            return calculate(expression)

    task = AdditionTask(num_digits=1, train_size=4, val_size=2)
    with pytest.raises(ValueError, match="tool_timeout applies to a trl_environment"):
        EnvironmentTask(task, environment=Countdown, tool_timeout=5.0)
    assert EnvironmentTask(task, trl_environment=Calculator, tool_timeout=5.0).environment().timeout == 5.0
    assert EnvironmentTask(task, trl_environment=Calculator).environment().timeout == 10.0


def test_environment_task_takes_exactly_one_environment():
    task = AdditionTask(num_digits=1, train_size=4, val_size=2)
    with pytest.raises(ValueError, match="exactly one of environment"):
        EnvironmentTask(task)
    with pytest.raises(ValueError, match="environment must be a class or a function"):
        EnvironmentTask(task, environment="Countdown")
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        EnvironmentTask(task, environment=Countdown, max_turns=0)


def test_the_embedded_agent_task_rewards_the_sum_in_the_last_turn_and_its_tool_answers_the_call():
    task = ToolAdditionTask(num_digits=5, train_size=50, val_size=10)
    assert not {r["prompt"] for r in task.train_records()} & {r["prompt"] for r in task.val_records()}
    rng = random.Random(0)
    for record in task.train_records():
        a, b = record["a"], record["b"]
        calling, answering = task.calling(record), task.answering(record)
        assert calling == [(f"calculate: {a:05d}+{b:05d}", f" = {a + b}\n"), (str(a + b), "")] and answering == [(str(a + b), "")]
        assert [task.reward(record, transcript) for transcript in task.solutions(record)] == [1.0, 1.0]
        assert task.reward(record, f"calculate: {a}+{b} = {a + b}\n{a + b + 1}") == 0.0
        environment = task.environment()
        environment.reset(record)
        reply = environment.step(calling[0][0])
        assert (reply.text, reply.done, reply.tool_calls, reply.tool_errors) == (calling[0][1], False, 1, 0)
        assert environment.step(calling[1][0]).done
        assert task.demonstration(record, rng) in (calling, answering)
    environment = task.environment()
    environment.reset(task.train_records()[0])
    unknown, malformed = environment.step("add: 1+2"), environment.step("1 2: 3")
    assert unknown.tool_errors == 1 and "no tool is named 'add'" in unknown.text
    assert malformed.tool_errors == 1 and "is not a tool's name" in malformed.text and not malformed.done


def test_supervised_warm_up_trains_the_turns_and_their_stop_tokens_not_the_observations():
    tokenizer = load_tokenizer("embedded:tiny-adder")

    class Attached(SFTDataModule):
        pass

    Attached.tokenizer = tokenizer

    data = Attached(ToolAdditionTask(num_digits=2, train_size=10, val_size=2))
    record = {"prompt": "guess 3-12:"}
    batch = data.collate([(record, [("7", " higher\n"), ("9", "")])])
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    assert batch["input_ids"][0].tolist() == ids("guess 3-12:") + ids("7") + [eos] + ids(" higher\n") + ids("9") + [eos]
    labelled = [-100] * len(ids("guess 3-12:")) + ids("7") + [eos] + [-100] * len(ids(" higher\n")) + ids("9") + [eos]
    assert batch["labels"][0].tolist() == labelled
    # text an environment's reset adds to the prompt (a pair without a turn) is in the context, neither trained nor closed
    batch = data.collate([(record, [("", " go:"), ("9", "")])])
    assert batch["input_ids"][0].tolist() == ids("guess 3-12:") + ids(" go:") + ids("9") + [eos]
    assert batch["labels"][0].tolist() == [-100] * len(ids("guess 3-12: go:")) + ids("9") + [eos]


def test_the_training_view_of_a_greedy_episode_predicts_each_of_its_turns_tokens_as_sampled():
    """Each turn was sampled from its own left-padded context; the episode's row, padded differently, must give the same
    next-token argmax at every policy position (positions and masks line up with the tokens across turns)."""
    module = RLModule(model_path="embedded:tiny-adder", max_new_tokens=40)
    records = AdditionTask(num_digits=3, train_size=2, val_size=1).train_records()

    class Echo(Environment):
        def reset(self, record):
            return None

        def step(self, action):
            return Observation("=" + action[:2])

    ids, mask = encoded(module.tokenizer, records)
    generation = run_episodes(module, Echo, EpisodeLimits(max_turns=3, max_episode_tokens=40), records, ids, mask, greedy=True)
    assert generation.stats["rollout/env_token_share"] > 0
    positions = torch.nonzero(generation.completion_mask)
    positions[:, 1] += generation.prompt_length - 1
    logprobs = module.next_token_logprobs(generation.input_ids, generation.attention_mask, positions)
    sampled = generation.input_ids[positions[:, 0], positions[:, 1] + 1]
    # the sampled token is the most likely one (up to rounding, which differs between the two paddings)
    assert (logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1) >= logprobs.max(-1).values - 1e-4).all()
    # and a sequence shifted by one position would not be: the check can fail
    assert not (logprobs.gather(1, sampled.roll(1).unsqueeze(1)).squeeze(1) >= logprobs.max(-1).values - 1e-4).all()


def test_an_agent_task_without_a_demonstration_replays_its_first_solution_as_one_turn_against_its_environment():
    class Single(AgentTask):
        def environment(self):
            return Countdown()

        def train_records(self):
            return [{"prompt": "q"}]

        val_records = train_records

        def reward(self, record, completion):
            return 0.0

        def solutions(self, record):
            return ["answer"]

    # the environment's reply to the turn, and what its reset adds to the prompt, as a pair without a turn
    assert Single().demonstration({"prompt": "q"}, random.Random(0)) == [("answer", " left 2\n")]
    assert Single().demonstration({"prompt": "q", "opening": " go:"}, random.Random(0)) == [("", " go:"), ("answer", " left 2\n")]


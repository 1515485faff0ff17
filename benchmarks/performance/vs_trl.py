"""lit_cancel against TRL's GRPOTrainer on identical work: seconds per optimizer step and peak memory.

    pip install -e ".[bench]"        # installs trl
    python benchmarks/performance/vs_trl.py [--rows small,large,large-ckpt] [--steps 10] [--warmup 2] [--threads N]
    python benchmarks/performance/vs_trl.py --realistic   # EOS on: rows real-small-fp32, real-small-bf16, real-large-fp32/bf16
    python benchmarks/performance/vs_trl.py --rows long-large-fp32,long-large-bf16 --steps 6 --warmup 1  # EOS rare: long completions
    python benchmarks/performance/vs_trl.py --rows qwen05-fp32,qwen05-bf16 --steps 2 --warmup 1   # Qwen2.5-0.5B's shape
    python benchmarks/performance/vs_trl.py --sweep --steps 3 --warmup 1   # completion limits 128 to 2,048 tokens, two regimes
    python benchmarks/performance/vs_trl.py --agent --steps 6 --warmup 2  # multi-turn, tool-using episodes (TRL environment_factory)

Each framework trains in its own process (its peak resident memory is that process's), one after
the other, on the same work, and the table gives lit_cancel's wall time per step as a share of TRL's.
Matched settings, both sides:

* the same randomly initialised Qwen2 (saved once, loaded by both) and the character tokenizer, CPU;
* float32 weights; the ``bf16`` rows train in bf16 autocast (TRL ``bf16=True``, lit_cancel ``precision="bf16-mixed"``),
  rollouts included, the others in float32;
* 8 prompts x 8 rollouts per step (group size 8; 4 in the qwen05 rows), one rollout round per optimizer step, one update per round
  (TRL ``num_iterations=1``, ``steps_per_generation=1``; lit_cancel ``mini_batches_per_round=1``, ``epochs_per_round=1``);
* fixed-length rows: exactly ``C`` new tokens per rollout, EOS suppressed with ``generation_kwargs={"suppress_tokens": [EOS]}``;
  realistic rows (``real-...``): rollouts stop at EOS or after ``C`` tokens. The random model's 99-token vocabulary
  makes EOS a roughly geometric stop, so completion lengths have a long tail, as real ones do;
* sampling at temperature 1, ``top_p=1``, ``top_k=0``; TRL samples with Hugging Face ``generate``, lit_cancel with
  its decode loop (no vLLM on either side);
* the GRPO objective: TRL ``loss_type="grpo"`` (per-sequence token mean), ``scale_rewards="group"``,
  ``epsilon=0.2``, ``beta=0``; lit_cancel ``GRPO()`` (the same terms, no reference model);
* the same prompts (3-digit additions) and reward (``AdditionTask.reward``);
* AdamW, lr 1e-6, no weight decay, gradient norm clipped at 1.0 (TRL's default ``max_grad_norm``); PyTorch's fused
  AdamW (one pass over each parameter's state) on both sides: TRL's default ``optim="adamw_torch_fused"``,
  lit_cancel ``torch.optim.AdamW(fused=True)``;
* activation checkpointing as the row says (TRL's ``GRPOConfig`` turns it on by default, lit_cancel off);
* the length sweep (``--sweep``): the 0.8 M model with checkpointing on (lit_cancel ``activation_checkpointing: chunks``),
  limits of 128 to 2,048 new tokens, each with lengths that vary (EOS's logit set for a mean length of 0.45 of the limit,
  about a fifth reaching it) and with every completion running to the limit (EOS suppressed);
* ``long-large-fp32`` and ``long-large-bf16`` (not in ``--realistic``): the 24 M model, at most 256 new tokens, EOS's
  logit set for a mean length of 0.86 of the limit (about 220 tokens, two thirds of the completions reach it);
* ``qwen05-fp32`` and ``qwen05-bf16`` (not in ``--realistic``): a random model of Qwen2.5-0.5B's shape (hidden 896,
  24 blocks, MLP 4,864, 14 query and 2 key/value heads, 151,936 tokens, tied head: 494 M parameters), 8 prompts x 4
  rollouts, at most 128 new tokens, checkpointing on; the character tokenizer padded to that vocabulary with tokens
  that decode as their names. EOS is on but is one token in 151,936, so nearly every completion runs to the limit;
* ``real-small-fp32-compiled`` (not in ``--realistic``): lit_cancel's decoder through ``torch.compile``
  (``RLModule(compile=True)``, opt-in), TRL as in ``real-small-fp32``; the warm-up steps hold the compilations.

The agent row (``--agent``): multi-turn GRPO with a tool, TRL's ``environment_factory`` against lit_cancel's
``EnvironmentTask(trl_environment=...)`` on one environment class, :class:`AdditionCalculator` (the ``calculate``
tool; ``reset`` takes the row), with the shipped ``embedded:tiny-agent`` model and its tokenizer, on
``ToolAdditionTask``'s 5-digit additions: the policy may write ``calculate: 12345+67890``, reads `` = 80235`` and a
newline, and answers; a turn without a colon is the answer and ends the episode. The same limits on both sides: 3
turns (TRL ``max_tool_calling_iterations=2``), 23 tokens a turn (TRL ``generation_kwargs={"max_new_tokens": 23}``),
138 tokens an episode after the prompt (TRL ``max_completion_length``); activation checkpointing off on both; the
other settings as above. TRL's tool loop renders prompts, calls and replies with the tokenizer's chat template and
reads the calls back with its ``response_template``; the character tokenizer has neither, so the benchmark gives it
both (:data:`COLON_CHAT_TEMPLATE`, :data:`COLON_RESPONSE_TEMPLATE`): a call renders ``name: expression`` closed by
EOS, a reply `` = result`` and a newline, a user message as its text with no generation prompt, so TRL's token
sequence of an episode is lit_cancel's (``ColonCalls``), and TRL runs its own tool loop on it (``rollout_func`` is not
needed). The reward is ``ToolAdditionTask.reward`` on the transcript, on both sides: the environment has no
``get_reward``, because the answer turn never reaches it (a turn that calls no tool ends the episode in both loops).
Each side counts the tokens it trains: lit_cancel the ones of ``completion_mask`` (the policy's turns with their EOS),
TRL those of ``completion_mask`` × ``tool_mask``; the environment's tokens are the rest of each episode after its
prompt. The table gives their means per episode with 95% intervals, and the tokens of a step's training pass: TRL's
episodes padded to the longest of the step (prompts and completions), lit_cancel's attended tokens, which its chunks
read without padding. One difference is by design of each framework: a call that fails (a tool that raises, a name
that is no tool) is answered ``{'error': '...'}`` by TRL and ``error: ValueError: ...`` by lit_cancel, so those
episodes' replies differ in length and their next turn reads another context (about 1% of the episodes of the shipped
model).

Steps are timed from one optimizer step's end to the next (rollouts, rewards, training, optimizer
and framework overhead all included); the first ``--warmup`` steps are not counted. Each side records
the length of every completion of the timed steps (EOS included): the table gives its mean with a 95%
interval, and says when the two means differ by more than their noise.
"""

import argparse
import json
import math
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from lit_cancel.agents import ColonCalls, EnvironmentTask, ToolAdditionTask
from lit_cancel.agents.calculator import calculate
from lit_cancel.hub import load_tokenizer, resolve_model_path
from lit_cancel.tasks import AdditionTask
from lit_cancel.tokenizer import build_char_tokenizer

PROMPTS, GROUP, LR, SEED = 8, 8, 1e-6, 0


@dataclass(frozen=True)
class Row:
    hidden: int
    blocks: int
    mlp: int
    heads: int
    new_tokens: int
    checkpointing: bool | str  # TRL's gradient checkpointing on or off; a string: lit_cancel's activation_checkpointing mode
    eos: bool = False
    bf16: bool = False
    compiled: bool = False  # lit_cancel's RLModule(compile=True); TRL as in the row without it
    # EOS on, its logit set so that completions are on average this share of new_tokens long
    mean_share: float | None = None
    kv_heads: int | None = None  # grouped-query attention's key/value heads; None: as many as heads
    vocab: int | None = None  # the model's vocabulary; None: the character tokenizer's, larger: padded with unused tokens
    group: int = GROUP  # rollouts per prompt


SMALL, LARGE, QWEN05 = (128, 3, 512, 4), (512, 8, 1280, 8), (896, 24, 4864, 14)
QWEN05_SHAPE = {"kv_heads": 2, "vocab": 151_936, "group": 4}
ROWS = {
    "small": Row(*SMALL, 48, False),
    "small-ckpt": Row(*SMALL, 48, True),
    "large": Row(*LARGE, 128, False),
    "large-ckpt": Row(*LARGE, 128, True),
    "real-small-fp32": Row(*SMALL, 128, False, eos=True),
    "real-small-bf16": Row(*SMALL, 128, False, eos=True, bf16=True),
    "real-large-fp32": Row(*LARGE, 256, True, eos=True),
    "real-large-bf16": Row(*LARGE, 256, True, eos=True, bf16=True),
    "real-small-fp32-compiled": Row(*SMALL, 128, False, eos=True, compiled=True),
    # EOS rarely sampled: completions average about 220 of the 256 tokens, about two thirds reach the limit;
    # lit_cancel's checkpointing as activation_checkpointing auto chooses it
    "long-large-fp32": Row(*LARGE, 256, "auto", eos=True, mean_share=0.86),
    "long-large-bf16": Row(*LARGE, 256, "auto", eos=True, bf16=True, mean_share=0.86),
    # Qwen2.5-0.5B's shape, random weights: EOS is one token in 151,936, so nearly every completion runs to the limit
    "qwen05-fp32": Row(*QWEN05, 128, True, eos=True, **QWEN05_SHAPE),
    "qwen05-bf16": Row(*QWEN05, 128, True, eos=True, bf16=True, **QWEN05_SHAPE),
}
REALISTIC = [name for name, row in ROWS.items() if name.startswith("real-") and not row.compiled]
# the length sweep: the small model, checkpointing on (TRL's default; lit_cancel by chunk, which keeps the least for a
# model of 3 blocks: docs/gpu.md), each limit in two regimes: lengths that vary
# (EOS's logit set for a mean length of 0.45 of the limit: a nearly geometric stop, about a fifth of completions reach it)
# and completions that all run to the limit (EOS suppressed)
SWEEP_LENGTHS = (128, 256, 512, 1024, 2048)
SWEEP = {}
for length in SWEEP_LENGTHS:
    SWEEP[f"varying-{length}"] = Row(*SMALL, length, "chunks", eos=True, mean_share=0.45)
    SWEEP[f"to-limit-{length}"] = Row(*SMALL, length, "chunks")
ROWS |= SWEEP


def write_model(folder: Path, row: Row) -> int:
    """Saves a random Qwen2 and the row's tokenizer to ``folder``; returns the parameter count."""
    tokenizer = row_tokenizer(row)
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(row_config(row, tokenizer))
    if row.mean_share is not None:
        set_mean_length(model, tokenizer, row.new_tokens, row.mean_share * row.new_tokens, row.group)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def row_config(row: Row, tokenizer) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=row.hidden, intermediate_size=row.mlp, num_hidden_layers=row.blocks,
        num_attention_heads=row.heads, num_key_value_heads=row.kv_heads or row.heads, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def set_mean_length(model: Qwen2ForCausalLM, tokenizer, limit: int, mean_length: float, group: int) -> None:
    """Points the (tied) embedding of EOS along the mean final hidden state, scaled so that completions of up to ``limit``
    tokens sampled at T = 1 are ``mean_length`` long on average, EOS included.

    EOS never precedes another token, so its embedding changes no context that a completion's next token is drawn
    in: one batch sampled with EOS suppressed holds the contexts, and each row's expected length
    ``sum_t prod_{s<t} (1 - p_s)`` follows from EOS's probability ``p_s`` at its positions, for any scale.
    """
    from lit_cancel.engines.decode_loop import logits_processors, sample_completions
    from lit_cancel.logprobs import position_ids_from_mask

    eos = tokenizer.eos_token_id
    prompts = tokenizer([r["prompt"] for r in AdditionTask(num_digits=3).train_records()[:PROMPTS]], return_tensors="pt", padding=True)
    torch.manual_seed(SEED)
    sequences = sample_completions(
        model, prompts["input_ids"], prompts["attention_mask"], group, limit, [], tokenizer.pad_token_id,
        logits_processors({"suppress_tokens": [eos]}, 1.0, 1.0, greedy=False),
    )
    prompt_length = prompts["input_ids"].shape[1]
    mask = torch.cat([prompts["attention_mask"].repeat_interleave(group, 0), torch.ones_like(sequences[:, prompt_length:])], 1)
    hidden = model.model(
        input_ids=sequences, attention_mask=mask, position_ids=position_ids_from_mask(mask),
    ).last_hidden_state[:, prompt_length - 1 : -1]
    weights = model.get_output_embeddings().weight
    others = torch.logsumexp(hidden @ torch.cat([weights[:eos], weights[eos + 1 :]]).T, dim=-1)
    direction = hidden.flatten(0, 1).mean(0)
    along = hidden @ (direction / direction.norm())

    def expected_length(scale: float) -> float:
        stop = torch.sigmoid(scale * along - others)  # EOS's probability at each position
        survival = torch.cumprod(1 - stop, dim=1)
        return (1 + survival[:, :-1].sum(1)).mean().item()

    low, high = -100.0, 100.0  # the expected length falls as the scale grows
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_length(middle) > mean_length else (low, middle)
    weights[eos] = (low + high) / 2 * direction / direction.norm()


def row_tokenizer(row: Row):
    """The character tokenizer, its vocabulary padded to ``row.vocab`` with tokens no text encodes to (a random model of
    a real vocabulary's size samples them, and they decode as their names)."""
    tokenizer = build_char_tokenizer()
    if row.vocab is None:
        return tokenizer
    vocab = tokenizer.get_vocab()
    vocab |= {f"<unused{i}>": i for i in range(len(vocab), row.vocab)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tokenizer.unk_token))
    backend.pre_tokenizer, backend.decoder = tokenizer.backend_tokenizer.pre_tokenizer, tokenizer.backend_tokenizer.decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=tokenizer.pad_token, eos_token=tokenizer.eos_token,
                                   unk_token=tokenizer.unk_token, padding_side="left")


def generation_kwargs(row: Row) -> dict:
    return {} if row.eos else {"suppress_tokens": [build_char_tokenizer().eos_token_id]}


def grpo_config(folder: str, steps: int, bf16: bool, group: int = GROUP, **settings):
    """TRL's ``GRPOConfig`` with what every row sets alike (lit_cancel's settings), and the row's ``settings``.

    ``bf16`` has no default here: ``GRPOConfig`` defaults it to True, which on a CPU trains in bfloat16 autocast."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(folder) / "trl"), max_steps=steps, per_device_train_batch_size=PROMPTS * group, num_generations=group,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="grpo", scale_rewards="group", epsilon=0.2, beta=0.0, num_iterations=1,
        learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=bf16, report_to="none", save_strategy="no",
        seed=SEED, logging_steps=1, dataloader_num_workers=0, **settings,
    )


def agent_config(folder: str, steps: int):
    """The agent row's ``GRPOConfig``: float32, no checkpointing, :func:`agent_task`'s limits."""
    limits = agent_task().limits
    return grpo_config(
        folder, steps, bf16=False, gradient_checkpointing=False, max_completion_length=limits.max_episode_tokens,
        max_tool_calling_iterations=limits.max_turns - 1, generation_kwargs={"max_new_tokens": limits.max_turn_tokens},
    )


def run_trl(folder: str, row: Row, steps: int) -> tuple[list[float], list[list[int]]]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    task = AdditionTask(num_digits=3)
    records = task.train_records()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    ends, lengths = [], []

    def reward(completions, answer, completion_ids, **kwargs):
        lengths.append([len(ids) for ids in completion_ids])  # the closing EOS included
        return [task.reward({"answer": a}, c) for a, c in zip(answer, completions)]

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = grpo_config(folder, steps, bf16=row.bf16, max_completion_length=row.new_tokens, generation_kwargs=generation_kwargs(row),
                         gradient_checkpointing=bool(row.checkpointing), group=row.group)
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=row_tokenizer(row), callbacks=[StepEnds()])
    trainer.train()
    return ends, lengths


def lit_cancel_module(folder: str, row: Row, **options):
    """The ``RLModule`` of a row: GRPO, sampling at T = 1, fused AdamW without weight decay; ``options`` override."""
    from lit_cancel import GRPO, RLModule

    settings = dict(
        objective=GRPO(clip_eps=0.2), temperature=1.0, top_p=1.0, max_new_tokens=row.new_tokens,
        activation_checkpointing=row.checkpointing, generation_kwargs=generation_kwargs(row), compile=row.compiled,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True),
    )
    return RLModule(folder, **{**settings, **options})


def fit_lit_cancel(module, folder: str, row: Row, steps: int, callbacks: list, task=None) -> None:
    """``Trainer.fit`` of ``module`` on ``task``'s prompts (the rows' additions when None) for ``steps`` optimizer steps, in
    the row's precision."""
    import lightning as L

    from lit_cancel import RolloutDataModule

    data = RolloutDataModule(task or AdditionTask(num_digits=3), prompts_per_round=PROMPTS, group_size=row.group, seed=SEED)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", precision="bf16-mixed" if row.bf16 else "32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, gradient_clip_val=1.0, callbacks=callbacks, default_root_dir=folder,
    )
    trainer.fit(module, data)


def run_lit_cancel(folder: str, row: Row, steps: int) -> tuple[list[float], list[list[int]]]:
    from lightning.pytorch.callbacks import Callback

    ends, lengths = [], []

    class StepEnds(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())
            lengths.append(batch.completion_mask.sum(1).tolist())

    fit_lit_cancel(lit_cancel_module(folder, row), folder, row, steps, [StepEnds()])
    return ends, lengths


AGENT, AGENT_MODEL = "agent", "embedded:tiny-agent"
AGENT_SHAPE = (128, 4, 512, 4)  # the shipped agent model's hidden size, blocks, MLP width and heads
# a call renders as ColonCalls writes it (its one argument, `expression`, bare; any other as key=value), closed by EOS;
# a tool's reply as ColonCalls shows a result; a user message as its text; the generation prompt is empty
COLON_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{ call.function.name ~ ': ' }}"
    "{%- for key, value in call.function.arguments.items() -%}"
    "{{ ' ' if not loop.first }}{{ key ~ '=' if key != 'expression' }}{{ value }}"
    "{%- endfor -%}"
    "{%- else -%}{{ message.content }}"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- elif message.role == 'tool' -%}{{ ' = ' ~ message.content ~ '\\n' }}"
    "{%- else -%}{{ message.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
# how transformers' parse_response reads a turn back (ColonCalls.parse): a turn closed by EOS that holds a colon is one
# call of the name before the first colon with the rest as its expression; any other turn is content, the answer. The
# assistant's message starts where the prompt ends (the empty generation prompt), so the anchor is the prefix's end.
COLON_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"\Z",
    "fields": {
        "tool_calls": {
            "open_pattern": r"^\s*(?P<name>[^:]*?)\s*:\s*(?=[\s\S]*<eos>)",
            "close_pattern": r"\s*<eos>",
            "repeats": True,
            "content": "text",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": {"expression": "{content}"}}},
        },
        "content": {"close": "<eos>", "content": "text"},
    },
}


class AdditionCalculator:
    """``ToolAdditionTask``'s environment as a TRL ``environment_factory``: one instance per episode, its public method
    the tool. TRL runs it through ``GRPOTrainer(environment_factory=AdditionCalculator)``, lit_cancel through
    ``EnvironmentTask(trl_environment=AdditionCalculator, call_format=ColonCalls())``."""

    def reset(self, **row) -> None:
        return None

    def calculate(self, expression: str) -> str:
        """Evaluates an arithmetic expression and returns its value.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) * 3 - 5".
        """
        return calculate(expression)


def agent_task() -> EnvironmentTask:
    """``ToolAdditionTask``'s records, limits and reward, its episodes run against :class:`AdditionCalculator`."""
    addition = ToolAdditionTask(num_digits=5)
    limits = addition.limits
    return EnvironmentTask(addition, trl_environment=AdditionCalculator, call_format=ColonCalls(), tool_timeout=5.0,
                           max_turns=limits.max_turns, max_turn_tokens=limits.max_turn_tokens,
                           max_episode_tokens=limits.max_episode_tokens)


def write_agent_model(folder: Path) -> int:
    """Copies the shipped agent model to ``folder``; returns its parameter count."""
    shutil.copytree(resolve_model_path(AGENT_MODEL), folder, dirs_exist_ok=True)
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())


def colon_chat_tokenizer(folder: str):
    """The tokenizer of ``folder`` with :data:`COLON_CHAT_TEMPLATE` and :data:`COLON_RESPONSE_TEMPLATE`."""
    tokenizer = load_tokenizer(folder)
    tokenizer.chat_template, tokenizer.response_template = COLON_CHAT_TEMPLATE, COLON_RESPONSE_TEMPLATE
    return tokenizer


def transcript(tokenizer, messages: list[dict]) -> str:
    """An episode's messages after the prompt as lit_cancel's transcript gives them: turns and replies, no EOS."""
    return tokenizer.apply_chat_template(messages, tokenize=False).replace(tokenizer.eos_token, "")


def run_trl_agent(folder: str, steps: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    task, tokenizer = agent_task(), colon_chat_tokenizer(folder)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in task.train_records()])
    ends, trained, environment, padded = [], [], [], []

    def reward(completions, answer, **kwargs):
        return [task.reward({"answer": a}, transcript(tokenizer, c)) for a, c in zip(answer, completions)]

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    class CountingTrainer(GRPOTrainer):
        """Records, per episode, the tokens the loss reads (completion mask × tool mask) and the environment's, and per step
        the tokens of the training pass (the episodes padded to the longest)."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            episode = output["completion_mask"]
            policy = episode * output["tool_mask"] if "tool_mask" in output else episode
            trained.append(policy.sum(1).tolist())
            environment.append((episode - policy).sum(1).tolist())
            padded.append(output["prompt_ids"].numel() + output["completion_ids"].numel())
            return output

    trainer = CountingTrainer(model=folder, reward_funcs=reward, args=agent_config(folder, steps), train_dataset=dataset,
                              processing_class=tokenizer, environment_factory=AdditionCalculator, callbacks=[StepEnds()])
    trainer.train()
    return {"ends": ends, "lengths": trained, "environment": environment, "pass_tokens": padded}


def run_lit_cancel_agent(folder: str, steps: int) -> dict:
    from lightning.pytorch.callbacks import Callback

    task = agent_task()
    ends, trained, environment, attended = [], [], [], []

    class StepEnds(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())
            episode = batch.attention_mask[:, batch.prompt_length:].sum(1)
            policy = batch.completion_mask.sum(1)
            trained.append(policy.tolist())
            environment.append((episode - policy).tolist())
            attended.append(int(batch.attention_mask.sum()))  # the training pass reads these, without padding

    row = Row(*AGENT_SHAPE, task.limits.max_turn_tokens, False, eos=True)
    fit_lit_cancel(lit_cancel_module(folder, row), folder, row, steps, [StepEnds()], task=task)
    return {"ends": ends, "lengths": trained, "environment": environment, "pass_tokens": attended}


def child(framework: str, folder: str, row: str, steps: int, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    if row == AGENT:
        result = (run_trl_agent if framework == "trl" else run_lit_cancel_agent)(folder, steps)
    else:
        ends, lengths = (run_trl if framework == "trl" else run_lit_cancel)(folder, ROWS[row], steps)
        result = {"ends": ends, "lengths": lengths}
    result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


@dataclass
class Measured:
    seconds: float  # median per step
    peak_mib: float
    lengths: list[int]  # every completion of the timed steps; of the agent row, the tokens each episode trains
    environment: list[int] = field(default_factory=list)  # the agent row: the environment's tokens of each episode
    pass_tokens: list[int] = field(default_factory=list)  # the agent row: the tokens of each timed step's training pass
    timed_steps: int = 1

    @property
    def mean_length(self) -> float:
        return statistics.fmean(self.lengths)

    @property
    def length_se(self) -> float:
        return standard_error(self.lengths)

    def limit_share(self, limit: int) -> float:
        """The share of completions that reached ``limit`` tokens (cut there, or ending at EOS exactly there)."""
        return sum(n >= limit for n in self.lengths) / len(self.lengths)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.lengths) / self.timed_steps / self.seconds


def standard_error(values: list[int]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values))


def measure(framework: str, folder: str, row: str, args: argparse.Namespace) -> Measured:
    """One framework in a fresh process: the median seconds per step after the warm-up, peak RSS and completion lengths."""
    command = [sys.executable, __file__, "--child", framework, "--folder", folder, "--row", row,
               "--steps", str(args.steps + args.warmup + 1)]
    command += ["--threads", str(args.threads)] if args.threads else []
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{framework} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    intervals = [b - a for a, b in zip(result["ends"], result["ends"][1:])][args.warmup:]
    # step k's lengths are those of the rollouts it trained on; the timed intervals end at steps warmup+1 ...
    timed_steps = slice(args.warmup + 1, args.warmup + 1 + len(intervals))

    def timed(counts: list[list[int]]) -> list[int]:
        return [n for step in counts[timed_steps] for n in step]

    return Measured(statistics.median(intervals), result["peak_mib"], timed(result["lengths"]), timed(result.get("environment", [])),
                    result.get("pass_tokens", [])[timed_steps], len(intervals))


def mean_cell(values: list[int]) -> str:
    return f"{statistics.fmean(values):.1f} ± {1.96 * standard_error(values):.1f}"


def length_cell(m: Measured) -> str:
    return mean_cell(m.lengths)


def differ(a: list[int], b: list[int]) -> bool:
    """Whether two means differ by more than 1.96 standard errors of their difference."""
    return abs(statistics.fmean(a) - statistics.fmean(b)) > 1.96 * math.hypot(standard_error(a), standard_error(b))


def agent_row(args: argparse.Namespace) -> None:
    """The agent row's table: both frameworks on :func:`agent_task`'s episodes."""
    with tempfile.TemporaryDirectory() as scratch:
        params = write_agent_model(Path(scratch))
        trl_run, lit_run = measure("trl", scratch, AGENT, args), measure("lit_cancel", scratch, AGENT, args)
    limits = agent_task().limits
    print("| work per step | TRL s/step | lit_cancel s/step | ratio | trained tokens per episode, TRL / lit_cancel "
          "| environment tokens per episode, TRL / lit_cancel | tokens in a step's training pass, TRL (padded) / lit_cancel "
          "| TRL peak RSS | lit_cancel peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    label = (f"{params / 1e6:.1f} M params ({AGENT_MODEL}), 5-digit additions with the calculate tool, at most "
             f"{limits.max_turns} turns of {limits.max_turn_tokens} tokens, fp32, checkpointing off")
    cells = []
    for counts in ("lengths", "environment"):
        trl_counts, lit_counts = getattr(trl_run, counts), getattr(lit_run, counts)
        cells.append(f"{mean_cell(trl_counts)} / {mean_cell(lit_counts)}{' (differ)' if differ(trl_counts, lit_counts) else ''}")
    print(f"| {label} | {trl_run.seconds:.3f} | {lit_run.seconds:.3f} | {lit_run.seconds / trl_run.seconds:.2f}x "
          f"| {cells[0]} | {cells[1]} | {statistics.fmean(trl_run.pass_tokens):,.0f} / {statistics.fmean(lit_run.pass_tokens):,.0f} "
          f"| {trl_run.peak_mib:,.0f} MiB | {lit_run.peak_mib:,.0f} MiB |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="small,large,large-ckpt", help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--realistic", action="store_true", help=f"the rows {', '.join(REALISTIC)} (EOS on)")
    parser.add_argument("--sweep", action="store_true",
                        help=f"the length sweep: {', '.join(map(str, SWEEP_LENGTHS))} tokens, lengths varying and running to the limit")
    parser.add_argument("--agent", action="store_true",
                        help="the agent row: multi-turn episodes with a tool, TRL's environment_factory against lit_cancel's")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per framework (median)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed")
    parser.add_argument("--threads", type=int, help="torch threads in each run (default: torch's choice)")
    parser.add_argument("--child", choices=["trl", "lit_cancel"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.folder, args.row, args.steps, args.threads)
        return
    try:
        import trl
    except ImportError:
        print("benchmarks/performance/vs_trl.py compares with TRL, which is not installed: pip install -e \".[bench]\"")
        return
    settings = (f"TRL {trl.__version__} GRPOTrainer vs lit_cancel, CPU, {args.threads or torch.get_num_threads()} threads; "
                f"{PROMPTS} prompts x {GROUP} rollouts per step (x 4 in the qwen05 rows), T=1, top_p=1, top_k=0, GRPO (TRL loss_type=grpo, "
                f"scale_rewards=group, epsilon=0.2), beta=0, one update per round, AdamW lr {LR:g}, grad-norm clip 1.0; median "
                f"of {args.steps} steps after {args.warmup} warm-up")
    if args.agent:
        print(f"{settings}; TRL environment_factory and lit_cancel EnvironmentTask(trl_environment=...) on one environment; "
              "tokens per episode: mean ± 95% interval, EOS included\n")
        agent_row(args)
        return
    rows = REALISTIC if args.realistic else list(SWEEP) if args.sweep else args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    print(f"{settings}; completion length: mean ± 95% interval, EOS included\n")
    print("| work per step | TRL s/step | lit_cancel s/step | ratio | TRL tokens/s | lit_cancel tokens/s "
          "| TRL length | lit_cancel length | reached the limit (TRL / lit_cancel) | TRL peak RSS | lit_cancel peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in rows:
        row = ROWS[name]
        with tempfile.TemporaryDirectory() as scratch:
            params = write_model(Path(scratch), row)
            trl_run, lit_run = measure("trl", scratch, name, args), measure("lit_cancel", scratch, name, args)
        stop = (f"EOS (mean {row.mean_share:g} of the limit) or " if row.mean_share else "EOS or ") if row.eos else "exactly "
        shape = " (Qwen2.5-0.5B shape)" if name.startswith("qwen05") else ""
        label = (f"{params / 1e6:.1f} M params{shape}, {stop}{row.new_tokens} tokens, {'bf16' if row.bf16 else 'fp32'}, "
                 f"checkpointing {'on' if row.checkpointing else 'off'}"
                 f"{f' (lit_cancel by {row.checkpointing})' if isinstance(row.checkpointing, str) else ''}"
                 f"{', lit_cancel compiled' if row.compiled else ''}")
        print(f"| {label} | {trl_run.seconds:.3f} | {lit_run.seconds:.3f} | {lit_run.seconds / trl_run.seconds:.2f}x "
              f"| {trl_run.tokens_per_s:,.0f} | {lit_run.tokens_per_s:,.0f} | {length_cell(trl_run)} | {length_cell(lit_run)}"
              f"{' (lengths differ)' if differ(trl_run.lengths, lit_run.lengths) else ''} "
              f"| {trl_run.limit_share(row.new_tokens):.0%} / {lit_run.limit_share(row.new_tokens):.0%} "
              f"| {trl_run.peak_mib:,.0f} MiB | {lit_run.peak_mib:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()

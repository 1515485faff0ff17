"""``compile: auto``: ``torch.compile`` the decoder where the run is long enough for compilation to pay.

What compiling buys is the time the framework spends around the arithmetic (Python, Hugging Face's modules, one kernel
call per operation), which fusing operations removes in part; it does not make matrix products faster, and its CPU
kernels (scalar: see :func:`lit_cancel.module.compile_decoder`) run a wide model's element-wise work slower than
eager PyTorch. Most of that time is spent decoding, a pass per token. It is measured once at start-up on a cut of the
model's config to a width of 8 per head (the same blocks, heads and operations, a vocabulary of 256, random weights),
where nearly all of a decoding step is that time. First, the cut's decoding step of one block is set against the
model's own (one block, its width and vocabulary): where it is under ``MIN_DISPATCH_SHARE`` of it, arithmetic
dominates and the run stays eager. Otherwise a step's saving is modelled as

    saving = SAVED_SHARE x the cut's decoding step x decoding steps of a round / optimizer steps of a round

(decoding steps: the task's token limit after a prompt; with an engine that holds its own weights, such as vLLM,
none: the run stays eager), and compilation's cost as ``SECONDS_PER_BLOCK`` for each block and kind of pass (rollouts,
training, and validation when the run validates: each compiles its own graphs, and a decoding cache that grows
compiles a few more). The decoder is compiled when ``max_steps x saving`` exceeds that cost.

The constants come from ``python benchmarks/performance/compile_rule.py`` on a 2-core AMD EPYC (its table is in
benchmarks/README.md): at 0.8 M parameters (3 blocks 128 wide, 64 rows of up to 128 tokens) compiling saved 0.27 s of
a 2.25 s step, 0.34 of the cut's decoding time, and cost 223 s, 37 s a block and kind, so it paid after about 840
steps; its one-block cut took 63-86% of the model's decoding step. At 24 M (8 blocks 512 wide, 15-28%) the compiled
step was slower. ``MIN_DISPATCH_SHARE`` lies between the two; the share saved and the cost are the smaller model's,
the one measurement where compiling paid.
"""

import statistics
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from lit_cancel.data import RolloutDataModule
from lit_cancel.engines.decode_loop import greedy_decoding_seconds
from lit_cancel.hub import cut_config
from lit_cancel.sharding import shards

AUTO = "auto"
# a step's saving from compiling, as a share of the narrow cut's time decoding the step's tokens
SAVED_SHARE = 0.34
# the least share of a decoding step spent around the arithmetic at which compiling was measured to save time
MIN_DISPATCH_SHARE = 0.5
# seconds of compilation per block of the decoder and kind of pass
SECONDS_PER_BLOCK = 37.0
HEAD_WIDTH = 8


@dataclass(frozen=True)
class CompileChoice:
    """Whether to compile the decoder, and why."""

    compile: bool
    reason: str


@dataclass(frozen=True)
class Overhead:
    """Seconds of a decoding step of the model cut to a width of 8 per head, and that cut's share of the time of a
    decoding step of the model itself, both cut to one block."""

    decode_step: float
    dispatch_share: float


def narrow_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` at 8 dimensions a head, an MLP twice as wide and a vocabulary of 256: the same blocks and operations, next
    to no arithmetic."""
    narrow = cut_config(config, config.num_hidden_layers, vocab_size=256)
    narrow.hidden_size = HEAD_WIDTH * config.num_attention_heads
    narrow.head_dim = HEAD_WIDTH
    narrow.intermediate_size = 2 * narrow.hidden_size
    return narrow


def decode_step_seconds(config: PretrainedConfig, rows: int, device: torch.device, repeats: int) -> float:
    """Median seconds of a decoding step of ``rows`` rows (16 steps from a cache of 8 prompt tokens) of a model of
    ``config`` with random weights, over ``repeats`` after one untimed."""
    model = AutoModelForCausalLM.from_config(config).to(device)
    prompts = torch.randint(config.vocab_size, (rows, 8), generator=torch.Generator().manual_seed(0)).to(device)
    greedy_decoding_seconds(model, prompts, 16)
    return statistics.median(greedy_decoding_seconds(model, prompts, 16) / 16 for _ in range(repeats))


def measure_overhead(config: PretrainedConfig, rows: int, device: torch.device, repeats: int = 5) -> Overhead:
    """:class:`Overhead` of a model of ``config`` decoding ``rows`` rows on ``device``."""
    narrow = narrow_config(config)
    narrow_one, wide_one = (decode_step_seconds(cut_config(c, 1), rows, device, repeats) for c in (narrow, config))
    return Overhead(decode_step_seconds(narrow, rows, device, repeats), min(1.0, narrow_one / wide_one))


def choose_compile(overhead: Overhead, steps: int, decoding_steps: float, blocks: int, kinds: int) -> CompileChoice:
    """Compile when ``steps`` optimizer steps, each with ``decoding_steps`` decoding steps, save more than compiling
    ``blocks`` blocks for ``kinds`` kinds of pass costs."""
    if overhead.dispatch_share < MIN_DISPATCH_SHARE:
        return CompileChoice(False, f"the framework's time around the arithmetic is {overhead.dispatch_share:.0%} of a decoding "
                                    f"step of one block, under the {MIN_DISPATCH_SHARE:.0%} where compiling was measured to pay")
    saving = SAVED_SHARE * overhead.decode_step * decoding_steps
    cost = SECONDS_PER_BLOCK * blocks * kinds
    facts = (f"{steps} steps x ~{saving * 1e3:.0f} ms saved a step = ~{steps * saving:.0f} s against ~{cost:.0f} s of "
             f"compiling {blocks} blocks for {kinds} kinds of pass")
    return CompileChoice(steps * saving > cost, facts)


def auto_compile(module, trainer) -> CompileChoice:
    """The choice for ``module``'s fit under ``trainer``: eager under a sharding strategy, with an engine that holds its
    own weights, and where the run's length or its rounds are unknown."""
    if shards(trainer.strategy):
        return CompileChoice(False, f"{type(trainer.strategy).__name__} shards the model, whose decoder is then not compiled")
    if module.engine.holds_weights:
        return CompileChoice(False, f"{type(module.engine).__name__} decodes with its own weights, where most of what "
                                    "compiling saves is")
    steps = trainer.max_steps
    if steps is None or steps < 1:
        return CompileChoice(False, "trainer.max_steps is not set, so the run's length is unknown")
    data = trainer.datamodule
    if not isinstance(data, RolloutDataModule):
        return CompileChoice(False, "the rounds are known only of a RolloutDataModule")
    rows = data.prompts_per_round // trainer.world_size * data.group_size
    decoding_steps = data.task.new_tokens_limit(module.max_new_tokens)[0] / data.steps_per_round
    config = module.policy.model.config.get_text_config(decoder=True)
    overhead = measure_overhead(config, rows, trainer.strategy.root_device)
    kinds = 2 + (trainer.limit_val_batches != 0)
    return choose_compile(overhead, steps, decoding_steps, config.num_hidden_layers, kinds)

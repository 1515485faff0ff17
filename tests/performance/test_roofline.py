"""benchmarks/performance/roofline.py's counts of a phase's work: a forward's FLOPs against PyTorch's own count, and
decoding's FLOPs, bytes and least time by hand."""

import pytest
import torch
from profile_step import RoundShape
from roofline import Limits, Shape, bound, decoding, phases, prefill_flops
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen2Config


@pytest.mark.parametrize("tied", [True, False])
def test_a_forwards_flops_are_what_pytorch_counts_less_the_masked_half_of_attention(tied):
    """PyTorch counts every product a forward makes (eager attention: its products over all L x L pairs of a row); the
    roofline counts attention's causal half, 2 x hidden x L^2 a block less."""
    config = Qwen2Config(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    shape = Shape.of(model)
    assert shape.kv_width == 32 and shape.head_weights == 99 * 64
    tokens = 12
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(99, (1, tokens)))
    assert counter.get_total_flops() == shape.forward_flops(tokens, tokens) + 2 * 2 * 64 * tokens**2


SHAPE = Shape(block_weights=100, head_weights=50, blocks=2, hidden=8, kv_width=4, trained=150)


def test_decoding_reads_the_weights_once_a_step_and_each_live_rows_cache():
    """Two rows of 3 prompt tokens, completions of 3 and 1 tokens: decode steps 1 and 2 run the first row alone, at
    contexts of 4 and 5. FLOPs 2 x 150 x 2 + 4 x 2 x 8 x (4 + 5) = 1,176; bytes (float32) 2 x 150 x 4 + 2 x 2 x 4 x (4 + 5)
    x 4 = 1,776; at 1,000 FLOP/s and 1,000 B/s each step is bound by its bytes: 0.856 + 0.920 s."""
    work = decoding(SHAPE, RoundShape([3, 3], [3, 1], prompts=1), 4, 1000.0, 1000.0)
    assert (work.flops, work.bytes, work.binds) == (1176, 1776, "memory")
    assert work.bound_s == pytest.approx(1.776)
    faster_memory = decoding(SHAPE, RoundShape([3, 3], [3, 1], prompts=1), 4, 1000.0, 10**6)
    assert faster_memory.binds == "compute" and faster_memory.bound_s == pytest.approx(1.176)


def test_prefill_counts_each_prompt_once_and_the_head_at_its_last_token():
    """4 rows, 2 prompts of 3 tokens: 2 x (2 x 100 x 3 + 2 x 50 + 2 x 2 x 8 x 9) = 2 x 988."""
    assert prefill_flops(SHAPE, RoundShape([3] * 4, [5, 2, 7, 1], prompts=2)) == 2 * 988


def test_a_phase_is_bound_by_the_slower_of_its_arithmetic_and_its_bytes():
    assert bound(100.0, 10.0, 10.0, 10.0).binds == "compute" and bound(100.0, 10.0, 10.0, 10.0).bound_s == 10.0
    assert bound(10.0, 100.0, 10.0, 10.0).binds == "memory" and bound(10.0, 100.0, 10.0, 10.0).bound_s == 10.0


def test_every_timed_part_of_a_step_is_set_against_its_bound():
    """A profiled step's parts, by hand: the training pass is three forwards over both rows' tokens, the optimizer 10
    float32 words a trained parameter; no log-prob pass; the rest has no bound."""
    step = {"prefill": 1.0, "decode": 2.0, "training forward": 3.0, "backward": 5.0, "optimizer": 0.5, "reward": 0.25,
            "advantages": 0.25, "other": 0.5}
    limits = Limits(float32_flops=1000.0, bfloat16_flops=10.0, bandwidth=1000.0)
    table = {phase: (seconds, work) for phase, seconds, work in
             phases([step], [RoundShape([3, 3], [3, 1], prompts=1)], SHAPE, limits, bf16=False, logprob_passes=0)}
    seconds, work = table["training forward + backward"]
    assert seconds == 8.0 and work.flops == 3 * (SHAPE.forward_flops(6, 3) + SHAPE.forward_flops(4, 1))
    assert work.bound_s == pytest.approx(work.flops / 1000.0)
    assert table["optimizer"][1].bytes == 10 * 4 * 150 and table["optimizer"][1].binds == "memory"
    assert table["old/ref log-probs"] == (0.0, None) and table["rest (reward, advantages, other)"] == (1.0, None)

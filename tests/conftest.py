import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from lit_cancel.tokenizer import build_char_tokenizer


def checkpoints_blocks(model: torch.nn.Module) -> bool:
    """Whether Hugging Face checkpoints each block of ``model`` (transformers 5.24 renamed ``is_gradient_checkpointing``)."""
    return model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") else model.is_gradient_checkpointing


def checksum_reward(record: dict, completion: str) -> float:
    """A reward that differs between random completions, so an untrained model gets non-zero advantages; configs load it as
    ``conftest.checksum_reward`` (tests/ is on the path of every test and of the runs they start)."""
    return float(sum(map(ord, completion)) % 7)


def agent_episodes(module, seed: int = 0, program: bool = False, greedy: bool = False):
    """Episodes of 4 ``ToolAdditionTask`` problems, 4 of each, through ``module``'s engine under ``torch.manual_seed(seed)``,
    checked as every engine must give them: some call the tool and then answer, and the tool's replies, which the policy
    mask leaves out, carry no sampler log-prob. ``program``: run by examples/agent_program's openai-SDK program through
    the endpoint (:class:`~lit_cancel.agents.ProgramTask`) instead of the task's environment."""
    from lit_cancel.agents import ColonCalls, ProgramTask, ToolAdditionTask
    from lit_cancel.rounds.sample import encode_prompts

    task = ToolAdditionTask(train_size=16, val_size=2)
    if program:
        task = ProgramTask(task, "calculator_agent.run", "embedded:tiny-agent", ColonCalls(), max_turns=3, max_turn_tokens=23,
                           max_episode_tokens=138)
    records = task.train_records()[:4]
    encoded = encode_prompts(module.tokenizer, records)
    torch.manual_seed(seed)
    generation = task.rollout(module, records, encoded["input_ids"], encoded["attention_mask"], num_samples=4, greedy=greedy)
    replies = generation.attention_mask[:, generation.prompt_length:].bool() & ~generation.completion_mask.bool()
    assert replies.any() and generation.stats["rollout/turns"] > 1
    assert generation.sampler_logprobs is None or (generation.sampler_logprobs[replies] == 0).all()
    return generation


def check_sampled_ahead(trained, versions, tolerance: float = 1e-4) -> int:
    """Checks batches of episodes sampled one round ahead, ``(step, batch)`` pairs with one step a round: every row 0 or 1
    round behind the step that trains it, the tool's replies without a sampler log-prob, and each policy token's sampler
    log-prob that of one of ``versions`` (optimizer step -> model) from its row's step to the training step, within
    ``tolerance``. Returns how many batches hold rows sampled a round earlier."""
    from lit_cancel.logprobs import completion_logprobs

    stale = 0
    for step, batch in trained:
        behind = step - batch.sampler_steps
        assert (behind >= 0).all() and (behind <= 1).all(), (step, batch.sampler_steps)
        stale += int((behind == 1).any())
        policy = batch.completion_mask.bool()
        replies = batch.attention_mask[:, batch.prompt_length:].bool() & ~policy
        assert replies.any(), "the episodes need the tool's replies between turns"
        assert (batch.sampler_logprobs[replies] == 0).all()
        closest = torch.full_like(batch.sampler_logprobs, float("inf"))
        for version in range(int(batch.sampler_steps.min()), step + 1):
            if version in versions:
                with torch.no_grad():
                    logprobs, _ = completion_logprobs(versions[version], batch.input_ids, batch.attention_mask, batch.prompt_length)
                closest = torch.minimum(closest, (logprobs - batch.sampler_logprobs).abs())
        assert closest[policy].max() < tolerance
    return stale


def save_tiny_model(folder, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A randomly initialised Qwen2 with the character tokenizer, saved as a Hugging Face folder."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it
QWEN_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen2.5-instruct-chat-template.jinja").read_text()


@pytest.fixture(scope="session")
def qwen_like_path(tmp_path_factory):
    """The tiny stand-in model, its tokenizer given Qwen2.5-Instruct's chat template and its context room for the
    template's tool instructions (one character a token)."""
    folder = save_tiny_model(tmp_path_factory.mktemp("qwen-like"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = Qwen2Config.from_pretrained(folder)
    config.max_position_embeddings = 2048
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory):
    rows = [
        {"question": f"Tom has {a} apples and buys {b} more. How many now?", "answer": f"He has {a}+{b}={a + b}.\n#### {a + b}"}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (9, 9), (3, 3), (8, 1), (2, 2), (5, 5)]
    ]
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def lit_cancel_script() -> str:
    """The ``lit-cancel`` console script: on PATH, or beside this Python (a virtual environment that is not activated)."""
    return shutil.which("lit-cancel") or str(Path(sys.executable).parent / "lit-cancel")


@pytest.fixture(scope="session")
def split_step():
    """``tests/workers/split_step.py``, loaded by its path: tests run it as a script in several processes, and call it here."""
    path = Path(__file__).parent / "workers" / "split_step.py"
    spec = importlib.util.spec_from_file_location("lit_cancel_tests_split_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lora_sizes(model) -> tuple[int, int]:
    """The bytes of a peft model's base weights (every name vLLM loads, a tied weight under each) and of its adapters."""
    state = model.state_dict()
    base = sum(t.numel() * t.element_size() for name, t in state.items() if ".lora_" not in name)
    return base, sum(t.numel() * t.element_size() for name, t in state.items() if ".lora_" in name)

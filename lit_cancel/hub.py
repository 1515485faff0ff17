"""Loading models and tokenizers from local Hugging Face folders, or the embedded tiny model."""

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_PREFIX = "embedded:"
ASSETS = Path(__file__).parent / "assets"


def resolve_model_path(path: str, option: str = "model_path") -> Path:
    """The folder behind ``path``: a local folder, or ``embedded:NAME`` for a model shipped in the package."""
    if path.startswith(EMBEDDED_PREFIX):
        name = path[len(EMBEDDED_PREFIX) :]
        folder = ASSETS / name
        if not (folder / "config.json").is_file():
            shipped = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())
            raise FileNotFoundError(f"{option}={path!r}: no embedded model {name!r}; shipped: {shipped}")
        return folder
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise FileNotFoundError(
            f"{option}={path!r} {what}; expected a local Hugging Face model folder "
            f"(config.json, weights, tokenizer) or '{EMBEDDED_PREFIX}tiny-adder'"
        )
    return folder


def load_tokenizer(path: str, option: str = "tokenizer_path") -> PreTrainedTokenizerBase:
    """The tokenizer in ``path``, left-padding, with a pad token (EOS when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path, option))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str, from_scratch: bool = False, dtype: str | None = None, option: str = "model_path", attn_implementation: str | None = None
) -> PreTrainedModel:
    """A causal LM from ``path`` with ``AutoModelForCausalLM``; random weights when ``from_scratch``; ``attn_implementation``
    as Hugging Face names it (None: its default)."""
    folder = resolve_model_path(path, option)
    torch_dtype = getattr(torch, dtype) if dtype else None
    if from_scratch:
        return AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(folder), dtype=torch_dtype, attn_implementation=attn_implementation
        )
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation=attn_implementation)


def cut_config(config: PretrainedConfig, blocks: int, vocab_size: int | None = None) -> PretrainedConfig:
    """A copy of ``config`` cut to its first ``blocks`` blocks (and their layer types), with ``vocab_size`` tokens where given
    (special token ids outside it become 0): a model of the same blocks' shape to measure at start-up."""
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = blocks
    if getattr(cut, "layer_types", None):
        cut.layer_types = cut.layer_types[:blocks]
    if vocab_size is not None:
        cut.vocab_size = vocab_size
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(getattr(cut, name, None), int) and getattr(cut, name) >= vocab_size:
                setattr(cut, name, 0)
    return cut

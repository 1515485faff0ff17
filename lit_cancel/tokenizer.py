"""A character-level ``PreTrainedTokenizerFast`` for the embedded tiny model.

One token per printable ASCII character plus three special tokens. It is small enough that a
1 M-parameter model spends its capacity on the task, and it is a real Hugging Face tokenizer: it
saves with ``save_pretrained`` and loads with ``AutoTokenizer.from_pretrained``.
"""

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Builds the character tokenizer; ids 0, 1, 2 are pad, eos and unk."""
    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )

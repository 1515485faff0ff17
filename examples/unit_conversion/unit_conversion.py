"""An environment written for TRL 1.16, run unchanged by lit_cancel: unit conversion with a tool.

As a TRL user writes it: ``GRPOTrainer(model, train_dataset=rows, environment_factory=UnitConverter,
reward_funcs=[correct_answer])``. The policy reads ``123mi>km=`` (123 miles in kilometres), may call ``convert`` and
answers with the number::

    123mi>km=convert: 123mi>km = 197.95
    197.95

lit_cancel runs it with ``configs/sft-environment.yaml`` (a tiny model trained from scratch on demonstrations replayed
against this environment) and ``configs/trl-environment.yaml`` (RL), with ``PYTHONPATH=examples/unit_conversion``.
``python examples/unit_conversion/unit_conversion.py`` writes the rows (``train.jsonl`` and ``val.jsonl`` beside it).
"""

import json
import random
import re
from pathlib import Path

FACTORS = {"mi>km": 1.609344, "km>mi": 1 / 1.609344, "lb>kg": 0.45359237, "kg>lb": 1 / 0.45359237}
QUANTITY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+>[a-z]+)\s*")


class UnitConverter:
    """One conversion problem: the tool converts, the environment keeps what it converted."""

    def reset(self, **row):
        self.conversions = []
        return None

    def convert(self, quantity: str) -> str:
        """Converts a quantity to another unit.

        Args:
            quantity: the amount and the units, from>to, as "123mi>km" (mi, km, lb or kg).
        """
        match = QUANTITY.fullmatch(quantity)
        if match is None or match[2] not in FACTORS:
            raise ValueError(f"write the amount and the units, as 123mi>km ({', '.join(FACTORS)}), not {quantity!r}")
        result = f"{float(match[1]) * FACTORS[match[2]]:.2f}"
        self.conversions.append(result)
        return result


def correct_answer(completions, answer, **kwargs):
    """TRL's reward function: 1.0 where the episode's last line is the row's answer, else 0.0."""
    return [float(completion.rsplit("\n", 1)[-1].strip() == expected) for completion, expected in zip(completions, answer)]


def demonstration_turns(row):
    """The policy's turns of an episode that succeeds on ``row``: the call, then the answer the tool gives."""
    return [f"convert: {row['prompt'].rstrip('=')}", row["answer"]]


def rows(seed=0):
    """Every conversion of 1 to 999 of each unit, shuffled by ``seed``: ``{"prompt": "123mi>km=", "answer": "197.95"}``."""
    problems = [(amount, units) for units in FACTORS for amount in range(1, 1000)]
    random.Random(seed).shuffle(problems)
    return [{"prompt": f"{amount}{units}=", "answer": f"{amount * factor:.2f}"}
            for amount, units in problems for factor in [FACTORS[units]]]


def write(folder, train_size=2000, val_size=200, seed=0):
    """``val.jsonl`` (the first ``val_size`` rows) and ``train.jsonl`` (the next ``train_size``) in ``folder``."""
    shuffled = rows(seed)
    for name, part in (("val.jsonl", shuffled[:val_size]), ("train.jsonl", shuffled[val_size:val_size + train_size])):
        Path(folder, name).write_text("".join(json.dumps(row) + "\n" for row in part))


if __name__ == "__main__":
    write(Path(__file__).parent)

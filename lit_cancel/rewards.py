"""Ready-made rewards for a task's ``reward_fn``: ``(record, completion) -> float``."""

from functools import lru_cache

from lit_cancel.tasks import Record


class MathVerifyReward:
    r"""1.0 when a completion's final answer equals the reference mathematically, else 0.0, checked by math-verify.

    The completion's answer is what Hugging Face's ``math_verify.parse`` extracts: the last
    ``\boxed{...}`` or LaTeX expression, else the last number. It is compared with the reference
    by ``math_verify.verify``, so ``\boxed{\frac{1}{2}}``, ``$1/2$`` and ``0.5`` all match a
    reference ``0.5``; a completion with no answer, or with two different boxed answers, scores
    0. The reference is the text after the last ``####`` of the record's ``answer_field`` (all of
    it when there is no ``####``), read as LaTeX; a reference math-verify cannot parse raises.

    Needs the optional extra: ``pip install "lit-cancel[math]"``. The check runs under
    math-verify's ``signal.alarm`` timeouts, so it must be called from a process's main thread.

    Args:
        answer_field: the record field holding the reference answer.

    Example (YAML)::

        task:
          class_path: lit_cancel.MathWordTask
          init_args:
            train_file: /data/math/train.jsonl
            reward_fn:
              class_path: lit_cancel.MathVerifyReward
    """

    def __init__(self, answer_field: str = "answer"):
        _math_verify()
        self.answer_field = answer_field

    def __call__(self, record: Record, completion: str) -> float:
        if self.answer_field not in record:
            raise KeyError(f"MathVerifyReward: the record has no field {self.answer_field!r} (fields: {sorted(record)})")
        reference = _parse_reference(str(record[self.answer_field]).rsplit("####", 1)[-1].strip())
        math_verify = _math_verify()
        return float(math_verify.verify(reference, math_verify.parse(completion)))


def _math_verify():
    try:
        import math_verify
    except ImportError as error:
        raise ImportError('MathVerifyReward needs the math-verify package; install it with: pip install "lit-cancel[math]"') from error
    return math_verify


@lru_cache(maxsize=4096)
def _parse_reference(text: str) -> list:
    parsed = _math_verify().parse(f"${text}$")
    if not parsed:
        raise ValueError(f"MathVerifyReward: math-verify cannot parse the reference answer {text!r}")
    return parsed

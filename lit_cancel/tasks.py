"""Tasks: where prompts come from and how a completion is rewarded.

A task hands out records (plain dicts with at least a ``"prompt"`` string), scores a completion of
a record with a verifiable reward, may say whether a completion is correct apart from its reward,
and lists correct reference completions for supervised warm-up and drift probes. Two tasks ship:
the embedded :class:`AdditionTask` and :class:`MathWordTask` for GSM8K-style files read through
``datasets``.
"""

import json
import logging
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from torch import Tensor

from lit_cancel.rounds.sample import Generation

Record = dict


class Task(ABC):
    """A source of prompt records with a verifiable reward.

    ``correct`` says whether a completion is right, apart from the reward that trains on it (a reward may give partial
    credit, reward a format, or be shaped). Where the task tells, ``rollout/accuracy`` and ``val/accuracy`` are shares
    of correct completions and each round logs ``rollout/reward_correct_corr``, the correlation of reward and
    correctness over its rollouts (not logged when either is the same for every rollout): a low value says the reward
    does not follow correctness. Where it cannot tell (``correct`` returns None, the default), ``rollout/accuracy``
    is the share of rewards above 0 and ``val/accuracy`` the mean reward.

    Attributes:
        rollout_in_one_call: :meth:`rollout` asks the policy for all its completions in one call, which an engine that
            samples ahead of the trainer can take in advance (:meth:`~lit_cancel.engines.RolloutEngine.prefetch`); a
            task whose rollout calls the policy several times (an :class:`~lit_cancel.agents.AgentTask`'s turns) sets it
            False, and its rollouts ahead of the trainer run in a background thread instead.
    """

    rollout_in_one_call: bool = True

    @abstractmethod
    def train_records(self) -> list[Record]:
        """Records to train on, in a fixed order."""

    @abstractmethod
    def val_records(self) -> list[Record]:
        """Held-out records for validation."""

    @abstractmethod
    def reward(self, record: Record, completion: str) -> float:
        """The reward of ``completion`` (decoded text, special tokens removed) for ``record``."""

    @abstractmethod
    def solutions(self, record: Record) -> list[str]:
        """Correct completions of ``record``; several where the task has equivalent solutions."""

    def correct(self, record: Record, completion: str) -> bool | None:
        """Whether ``completion`` answers ``record`` correctly, whatever its reward; None when the task cannot tell."""
        return None

    def record_source(self, split: str, index: int) -> str:
        """Where record ``index`` of ``split`` (``"train"`` or ``"val"``) comes from, for messages."""
        return f"{split} record {index}"

    def check_startup(self) -> None:
        """Builds what the task's rollouts need beyond its records (an agent task's environment), so that a mistake in
        it fails at start-up: ValueError in one line. Nothing here."""
        return None

    def demonstration(self, record: Record, rng: random.Random) -> list[tuple[str, str]]:
        """A rollout that succeeds on ``record``, as ``(turn, observation)`` pairs, for supervised warm-up (each turn is
        trained and closed by EOS, observations are not; a pair whose turn is empty is text before the first turn): here
        one of the task's solutions, drawn by ``rng``, as one turn."""
        return [(rng.choice(self.solutions(record)), "")]

    def new_tokens_limit(self, max_new_tokens: int | None) -> tuple[int | None, str, str]:
        """``(tokens, name, option)``: how many tokens may follow a prompt, its name and the option that sets it; here a
        completion's, the policy module's ``max_new_tokens``."""
        return max_new_tokens, "max_new_tokens", "model.init_args.max_new_tokens"

    def drift_probes(self, count: int) -> list[dict]:
        """Up to ``count`` held-out prompts with their reference solutions, each one completion of its prompt, for
        ``SolutionProbabilityDriftMonitor``."""
        return [{"prompt": r["prompt"], "solutions": self.solutions(r)} for r in self.val_records()[:count]]

    def rollout(self, policy, records: list[Record], input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1,
                greedy: bool = False, names: Sequence[str] | None = None) -> Generation:
        """``num_samples`` rollouts of each of ``records`` by ``policy`` (a :class:`~lit_cancel.rounds.sample.RolloutPolicy`),
        whose prompts ``input_ids`` holds left-padded: here one
        completion each by ``policy.rollout``; an :class:`~lit_cancel.agents.AgentTask` runs an episode of several
        turns against its environment instead. ``names`` says how messages name each record (``"val record 3"``,
        :func:`~lit_cancel.rounds.draw.record_names`), by its place in ``records`` when None."""
        return policy.rollout(input_ids, attention_mask, num_samples, greedy)


class WrappingTask(Task):
    """A task that runs another task's records in another way (an environment's episodes, an agent program's): its
    ``reward``, ``correct``, ``solutions`` and ``record_source`` are those of the wrapped ``task``."""

    task: Task

    def reward(self, record: Record, completion: str) -> float:
        return self.task.reward(record, completion)

    def correct(self, record: Record, completion: str) -> bool | None:
        return self.task.correct(record, completion)

    def solutions(self, record: Record) -> list[str]:
        return self.task.solutions(record)

    def record_source(self, split: str, index: int) -> str:
        return self.task.record_source(split, index)


class AdditionTask(Task):
    """Multi-digit addition with a written, digit-by-digit scratchpad.

    The prompt is ``"047+385="``. A completion writes one step per digit from the right, each with
    its carry, then the answer after ``|``::

        7+5+0=12,4+8+1=13,0+3+1=4|432

    Only the number after ``|`` is verified: a completion is correct when it is the sum. The two
    operands of each step may be written in either order, so a problem has up to ``2**num_digits``
    equivalent correct solutions.

    Args:
        num_digits: digits per operand; operands are zero-padded, so every prompt has one length.
        train_size: number of training problems.
        val_size: number of held-out problems, disjoint from the training problems.
        seed: seed of the generator that draws both splits.
        reward_fn: ``(record, completion) -> float``; None rewards a correct answer with 1.0 and anything else
            with 0.0. Correctness (``rollout/accuracy``, ``val/accuracy``) is the exact answer whatever the reward.
    """

    def __init__(
        self, num_digits: int = 3, train_size: int = 5000, val_size: int = 200, seed: int = 0,
        reward_fn: Callable[[Record, str], float] | None = None,
    ):
        if num_digits < 1:
            raise ValueError(f"AdditionTask: num_digits must be >= 1, got {num_digits}")
        if train_size < 1 or val_size < 1:
            raise ValueError(f"AdditionTask: train_size and val_size must be >= 1, got {train_size} and {val_size}")
        if train_size + val_size > 10 ** (2 * num_digits) // 2:
            raise ValueError(
                f"AdditionTask: {train_size + val_size} problems requested, but {num_digits}-digit operands "
                f"allow at most {10 ** (2 * num_digits) // 2} distinct ones; lower train_size/val_size"
            )
        self.num_digits, self.reward_fn = num_digits, reward_fn
        rng = random.Random(seed)
        pairs: dict[tuple[int, int], None] = {}
        while len(pairs) < train_size + val_size:
            pairs.setdefault((rng.randrange(10**num_digits), rng.randrange(10**num_digits)))
        ordered = list(pairs)
        self._val = [self._record(a, b) for a, b in ordered[:val_size]]
        self._train = [self._record(a, b) for a, b in ordered[val_size:]]

    def _record(self, a: int, b: int) -> Record:
        n = self.num_digits
        return {"prompt": f"{a:0{n}d}+{b:0{n}d}=", "a": a, "b": b, "answer": str(a + b)}

    def train_records(self) -> list[Record]:
        return self._train

    def val_records(self) -> list[Record]:
        return self._val

    def reward(self, record: Record, completion: str) -> float:
        return self.reward_fn(record, completion) if self.reward_fn is not None else float(self.correct(record, completion))

    def correct(self, record: Record, completion: str) -> bool:
        return parse_addition_answer(completion) == record["answer"]

    def solution(self, record: Record, swap: list[bool]) -> str:
        """The scratchpad solution; ``swap[i]`` writes step ``i``'s operands in reverse order."""
        a, b, carry, steps = record["a"], record["b"], 0, []
        for i in range(self.num_digits):
            x, y = a // 10**i % 10, b // 10**i % 10
            total = x + y + carry
            first, second = (y, x) if swap[i] else (x, y)
            steps.append(f"{first}+{second}+{carry}={total}")
            carry = total // 10
        return ",".join(steps) + "|" + record["answer"]

    def solutions(self, record: Record) -> list[str]:
        n = self.num_digits
        variants = (self.solution(record, [bool(mask >> i & 1) for i in range(n)]) for mask in range(2**n))
        return list(dict.fromkeys(variants))


# what a solution restates before its steps, and what a verbose solution adds after each step
# (no spaces: the character tokenizer drops them; no digits, ",", "|": they are the steps' syntax)
SCAFFOLD_TEXT = "we-add-the-digits-from-the-right-one-column-at-a-time-and-carry-the-tens:"
VERBOSE_TEXT = ";so-we-write-the-last-digit-and-carry-the-rest"


class ScaffoldedAdditionTask(AdditionTask):
    """Addition whose solutions share a scaffold and differ in length: the two conditions of cancellation.

    The prompt states the format, then the problem: ``"s16v6:047+385="``. A solution writes the
    first ``scaffold`` characters of :data:`SCAFFOLD_TEXT` (a fixed preamble every rollout of a
    group shares at the same positions), then :class:`AdditionTask`'s steps and answer. A verbose
    solution adds the first ``spread`` characters of :data:`VERBOSE_TEXT` after every step, so
    equally correct solutions of one problem differ in length by ``num_digits * spread``
    characters. With ``scaffold=16, spread=6``::

        we-add-the-digit7+5+0=12;so-we,4+8+1=13;so-we,0+3+1=4;so-we|432     (verbose)
        we-add-the-digit5+7+0=12,8+4+1=13,3+0+1=4|432                        (terse)

    Operands of a step may be written in either order, as in :class:`AdditionTask`, so a problem
    has ``2**num_digits`` equivalent solutions of each length. Only the number after the last ``|``
    is verified.

    Args:
        scaffold: characters of the shared preamble; a list draws one value per problem (for
            supervised warm-up over several settings).
        spread: characters a verbose solution adds per step; a list draws one value per problem.
        num_digits: digits per operand.
        train_size: number of training problems.
        val_size: number of held-out problems, disjoint from the training problems.
        seed: seed of the generator that draws both splits and the per-problem settings.
        reward_fn: ``(record, completion) -> float``; None: 1.0 for a correct answer, else 0.0 (see :class:`AdditionTask`).
    """

    def __init__(
        self,
        scaffold: int | list[int] = 16,
        spread: int | list[int] = 6,
        num_digits: int = 3,
        train_size: int = 5000,
        val_size: int = 200,
        seed: int = 0,
        reward_fn: Callable[[Record, str], float] | None = None,
    ):
        self.scaffolds = self._choices("scaffold", scaffold, len(SCAFFOLD_TEXT))
        self.spreads = self._choices("spread", spread, len(VERBOSE_TEXT))
        self._settings = random.Random(f"settings-{seed}")
        super().__init__(num_digits, train_size, val_size, seed, reward_fn)

    @staticmethod
    def _choices(name: str, value: int | list[int], limit: int) -> list[int]:
        values = [value] if isinstance(value, int) else list(value)
        if not values or any(not isinstance(v, int) or not 0 <= v <= limit for v in values):
            raise ValueError(f"ScaffoldedAdditionTask: {name} must be an int or a non-empty list of ints in 0..{limit}, got {value!r}")
        return values

    def _record(self, a: int, b: int) -> Record:
        scaffold, spread = self._settings.choice(self.scaffolds), self._settings.choice(self.spreads)
        record = super()._record(a, b)
        record.update(prompt=f"s{scaffold}v{spread}:" + record["prompt"], scaffold=scaffold, spread=spread)
        return record

    def solution(self, record: Record, swap: list[bool], verbose: bool = False) -> str:
        """The solution; ``swap[i]`` reverses step ``i``'s operands, ``verbose`` adds the per-step text."""
        steps, answer = super().solution(record, swap).split("|")
        after = VERBOSE_TEXT[: record["spread"]] if verbose else ""
        return SCAFFOLD_TEXT[: record["scaffold"]] + ",".join(step + after for step in steps.split(",")) + "|" + answer

    def solutions(self, record: Record) -> list[str]:
        n = self.num_digits
        styles = [False, True] if record["spread"] else [False]
        variants = (
            self.solution(record, [bool(mask >> i & 1) for i in range(n)], verbose)
            for verbose in styles for mask in range(2**n)
        )
        return list(dict.fromkeys(variants))


def parse_addition_answer(completion: str) -> str | None:
    """The digits after the last ``|``, or None when the completion does not end in ``|<digits>``."""
    match = re.search(r"\|(\d+)\s*$", completion)
    return match.group(1).lstrip("0") or "0" if match else None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_final_number(text: str) -> float | None:
    """The number after ``####`` if present, else the last number in ``text``; commas ignored."""
    marked = "####" in text
    numbers = _NUMBER.findall(text.rsplit("####", 1)[1] if marked else text)
    if not numbers:
        return None
    return float(numbers[0 if marked else -1].replace(",", ""))


def final_number_reward(record: Record, completion: str) -> float:
    """1.0 when the completion's final number equals the reference answer's number, else 0.0."""
    predicted = parse_final_number(completion)
    return float(predicted is not None and abs(predicted - record["answer_number"]) < 1e-6)


def _not_utf8_because(file: Path) -> str | None:
    """Where ``file`` stops being UTF-8 (its line and byte column, 1-based), or None when it is UTF-8 throughout."""
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = data.count(b"\n", 0, bad.start) + 1
        column = bad.start - data.rfind(b"\n", 0, bad.start)
        return f"line {line} is not UTF-8 (byte 0x{data[bad.start]:02x} at column {column}); save the file as UTF-8"
    return None


@contextmanager
def _loader_errors_unlogged() -> Iterator[None]:
    """Keeps the loaders of ``datasets`` from logging why they cannot read a file: the task raises its own message, which
    names the file's line (:func:`_unreadable_because`) where theirs names a row counted from 0."""
    loaders = logging.getLogger("datasets.packaged_modules")
    level = loaders.level
    loaders.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        loaders.setLevel(level)


def _row_lines(file: Path) -> list[str]:
    """How each row of ``file`` is named in messages: its line in a jsonl file (1-based, blank lines counted), else its row."""
    if file.suffix == ".jsonl":
        return [f"line {number}" for number, line in enumerate(file.read_text().splitlines(), start=1) if line.strip()]
    return []


def _json_kind(value: object) -> str:
    """How a JSON value that is not an object is named in messages: "a JSON array", "a JSON number", ..."""
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return f"a JSON {kinds[type(value)]}" if type(value) in kinds else "JSON null"


def _unreadable_because(file: Path, error: Exception, expected: str, row_problem: Callable[[dict], str | None]) -> str:
    """Why ``datasets`` could not read ``file``: the first JSON line (or document) that does not parse, or the first row
    that is not an object or whose fields ``row_problem`` finds wrong, where there is one; ``expected`` says what rows the
    reader takes."""
    if file.suffix == ".parquet":
        return f"is not a readable parquet file ({error})"
    text = file.read_text(errors="replace")
    if not text.strip():
        return "is empty; expected one JSON object per line"
    try:
        document = json.loads(text)
    except json.JSONDecodeError as bad:
        if file.suffix == ".json" and text.lstrip().startswith("["):
            return f"is not valid JSON: line {bad.lineno} column {bad.colno}: {bad.msg}"
        document = None
    if isinstance(document, list):
        if not document:
            return "holds an empty list; expected a list of JSON objects"
        rows = [(f"row {number}", row) for number, row in enumerate(document, start=1)]
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as bad:
                    return f"line {number} is not valid JSON ({bad.msg} at column {bad.colno}); expected one JSON object per line"
    for where, row in rows:
        if not isinstance(row, dict):
            return f"{where} is {_json_kind(row)}, not an object; {expected}"
        if problem := row_problem(row):
            return f"{where} {problem}"
    cause = error.__cause__ or error
    return f"could not be read ({type(cause).__name__}: {cause})"


def read_rows(path: str, reader: str, expected: str, row_problem: Callable[[dict], str | None]) -> tuple[list[dict], list[str]]:
    """The rows of a ``.jsonl``, ``.json`` or ``.parquet`` file, read with ``datasets``, and where each comes from
    (``"'path' line N"`` in a jsonl file, else ``"'path' row N"``).

    A file that is missing, a folder, of another kind, not UTF-8, empty or unreadable raises one line beginning with
    ``reader`` (the task's name) and naming the file and, where it can, the line: FileNotFoundError for a missing file,
    ValueError otherwise. ``expected`` says what rows the reader takes, and ``row_problem`` what is wrong with one row
    (None where nothing is), for the message about a file that ``datasets`` cannot read.
    """
    import datasets

    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{reader}: data file {path!r} is a folder; name a .jsonl, .json or .parquet file in it")
    if not file.is_file():
        raise FileNotFoundError(f"{reader}: data file {path!r} does not exist")
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(file.suffix)
    if builder is None:
        raise ValueError(f"{reader}: data file {path!r} must end in .jsonl, .json or .parquet")
    if builder == "json" and (not_utf8 := _not_utf8_because(file)):
        raise ValueError(f"{reader}: data file {path!r} {not_utf8}")
    try:
        with _loader_errors_unlogged():
            rows = datasets.load_dataset(builder, data_files=str(file), split="train")
    except Exception as error:
        raise ValueError(f"{reader}: data file {path!r} {_unreadable_because(file, error, expected, row_problem)}") from error
    if len(rows) == 0:
        raise ValueError(f"{reader}: data file {path!r} has no rows")
    lines = _row_lines(file)
    sources = [f"{path!r} {lines[index] if index < len(lines) else f'row {index + 1}'}" for index in range(len(rows))]
    return list(rows), sources


def _field_problem(row: dict, fields: tuple[str, ...]) -> str | None:
    """What is wrong with the question and answer fields of one row, or None when both hold text."""
    for field in fields:
        if field in row and not (isinstance(row[field], str) and row[field].strip()):
            return f"field {field!r} is {row[field]!r}; expected non-empty text"
    return None


def split_records(reader: str, load: Callable[[str], tuple[list[Record], list[str]]], train_file: str, val_file: str | None,
                  val_size: int) -> tuple[list[Record], list[Record], dict[str, list[str]]]:
    """``(train, val, sources)``: the records ``load`` makes of ``train_file`` and of ``val_file``, or where ``val_file`` is
    None the last ``val_size`` of ``train_file``'s held out; ``sources[split][i]`` where record ``i`` of a split comes from.
    ``load(path)`` returns a file's records and their sources (:func:`read_rows`); messages begin with ``reader``."""
    train, train_sources = load(train_file)
    if val_file is not None:
        val, val_sources = load(val_file)
        return train, val, {"train": train_sources, "val": val_sources}
    if not 0 < val_size < len(train):
        raise ValueError(
            f"{reader}: val_size={val_size} must be between 1 and the {len(train)} rows of {train_file} minus one, or give val_file"
        )
    return train[:-val_size], train[-val_size:], {"train": train_sources[:-val_size], "val": train_sources[-val_size:]}


class MathWordTask(Task):
    """GSM8K-style word problems from local jsonl, json or parquet files, read with ``datasets``.

    Each row needs a question field and an answer field whose final number follows ``####``
    (``"... so she has 5 apples.\\n#### 5"``).

    Args:
        train_file: path of the training rows (``.jsonl``, ``.json`` or ``.parquet``).
        val_file: path of the held-out rows; when None, the last ``val_size`` training rows are held out.
        val_size: held-out rows taken from ``train_file`` when ``val_file`` is None.
        question_field: name of the question field.
        answer_field: name of the answer field.
        prompt_template: format string for the prompt, with a ``{question}`` placeholder.
        reward_fn: ``(record, completion) -> float``; defaults to :func:`final_number_reward`. Correctness
            (``rollout/accuracy``, ``val/accuracy``) is :func:`final_number_reward`'s check whatever the reward.
    """

    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        val_size: int = 100,
        question_field: str = "question",
        answer_field: str = "answer",
        prompt_template: str = "Question: {question}\nAnswer:",
        reward_fn: Callable[[Record, str], float] = final_number_reward,
    ):
        if "{question}" not in prompt_template:
            raise ValueError(f"MathWordTask: prompt_template must contain '{{question}}', got {prompt_template!r}")
        self.question_field, self.answer_field = question_field, answer_field
        self.prompt_template, self.reward_fn = prompt_template, reward_fn
        self._train, self._val, self._sources = split_records("MathWordTask", self._load, train_file, val_file, val_size)

    def record_source(self, split: str, index: int) -> str:
        return self._sources[split][index]

    def _load(self, path: str) -> tuple[list[Record], list[str]]:
        """The records of ``path``, and where each comes from (``"'path' line N"``)."""
        fields = (self.question_field, self.answer_field)
        rows, sources = read_rows(path, "MathWordTask", f"expected JSON objects with the fields {fields[0]!r} and {fields[1]!r}",
                                  lambda row: _field_problem(row, fields))
        missing = [f for f in fields if f not in rows[0]]
        if missing:
            raise ValueError(
                f"MathWordTask: data file {path!r} has no field {missing[0]!r} (fields: {list(rows[0])}); "
                f"expected rows with {self.question_field!r} and {self.answer_field!r}, or set question_field/answer_field"
            )
        records = []
        for index, row in enumerate(rows):
            if problem := _field_problem({self.question_field: row[self.question_field]}, (self.question_field,)):
                raise ValueError(f"MathWordTask: {sources[index]} {problem}")
            answer = row[self.answer_field]
            number = parse_final_number(answer) if isinstance(answer, str) and "####" in answer else None
            if number is None:
                raise ValueError(
                    f"MathWordTask: {sources[index]} field {self.answer_field!r} is {answer!r}; "
                    "expected text ending in '#### <number>'"
                )
            records.append(
                {
                    "prompt": self.prompt_template.format(question=row[self.question_field]),
                    "answer": answer,
                    "answer_number": number,
                }
            )
        return records, sources

    def train_records(self) -> list[Record]:
        return self._train

    def val_records(self) -> list[Record]:
        return self._val

    def reward(self, record: Record, completion: str) -> float:
        return self.reward_fn(record, completion)

    def correct(self, record: Record, completion: str) -> bool:
        return final_number_reward(record, completion) == 1.0

    def solutions(self, record: Record) -> list[str]:
        return [" " + record["answer"]]


def _prompt_problem(row: dict) -> str | None:
    """What is wrong with a row's ``prompt``, or None where it is non-empty text or a list of chat messages (each a mapping
    with a ``role``)."""
    if "prompt" not in row:
        return None
    prompt = row["prompt"]
    if isinstance(prompt, str) and prompt.strip():
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
        return None
    return (f"field 'prompt' is {prompt!r}; expected non-empty text or a list of chat messages "
            "([{'role': 'user', 'content': ...}, ...])")


class DatasetTask(Task):
    """A dataset file's rows, each a record as it is: how a TRL dataset runs unchanged, with an
    :class:`~lit_cancel.agents.EnvironmentTask` around it.

    Each row of a ``.jsonl``, ``.json`` or ``.parquet`` file (read with ``datasets``) is one record with all its fields,
    which a TRL environment's ``reset(**row)`` and TRL's reward functions receive. Its ``prompt`` is text, or a list of
    chat messages (TRL's conversational format, ``[{"role": "user", "content": ...}]``), which the EnvironmentTask's
    ``chat_template`` renders.

    The task has no reward of its own unless ``reward_fn`` gives one: the EnvironmentTask's ``reward_funcs`` (TRL's reward
    functions) or its environment (``get_reward``) score the episodes, and the task's reward is 0.0 for an episode they
    all leave unscored (they return None). Used on its own, without ``reward_fn``, it is refused at start-up.

    Args:
        train_file: path of the training rows (``.jsonl``, ``.json`` or ``.parquet``).
        val_file: path of the held-out rows; when None, the last ``val_size`` training rows are held out.
        val_size: held-out rows taken from ``train_file`` when ``val_file`` is None.
        reward_fn: ``(record, completion) -> float``, where the task scores completions itself; None: it does not.
        solution_field: a field holding a correct completion of each row (text), what :meth:`solutions` returns (the
            default supervised warm-up of one turn, drift probes); None: the task has no solutions.
    """

    def __init__(self, train_file: str, val_file: str | None = None, val_size: int = 100,
                 reward_fn: Callable[[Record, str], float] | None = None, solution_field: str | None = None):
        self.reward_fn, self.solution_field = reward_fn, solution_field
        self._train, self._val, self._sources = split_records("DatasetTask", self._load, train_file, val_file, val_size)

    def _load(self, path: str) -> tuple[list[Record], list[str]]:
        """The rows of ``path`` as records, and where each comes from; each row's prompt checked."""
        rows, sources = read_rows(path, "DatasetTask", "expected JSON objects with a 'prompt' field", _prompt_problem)
        required = ["prompt"] + ([self.solution_field] if self.solution_field is not None else [])
        missing = [field for field in required if field not in rows[0]]
        if missing:
            option = "" if missing[0] == "prompt" else " (solution_field)"
            raise ValueError(f"DatasetTask: data file {path!r} has no field {missing[0]!r}{option} (fields: {list(rows[0])}); "
                             "expected rows with a 'prompt', text or a list of chat messages, as TRL's datasets have")
        for index, row in enumerate(rows):
            if problem := _prompt_problem(row):
                raise ValueError(f"DatasetTask: {sources[index]} {problem}")
        return rows, sources

    def record_source(self, split: str, index: int) -> str:
        return self._sources[split][index]

    def train_records(self) -> list[Record]:
        return self._train

    def val_records(self) -> list[Record]:
        return self._val

    def reward(self, record: Record, completion: str) -> float:
        """``reward_fn``'s where given, else 0.0: the reward of a completion (an episode) that nothing else scored."""
        return self.reward_fn(record, completion) if self.reward_fn is not None else 0.0

    def solutions(self, record: Record) -> list[str]:
        """The row's ``solution_field``; ValueError where the task has none."""
        if self.solution_field is None:
            raise ValueError("DatasetTask has no solutions: set solution_field to a field holding a correct completion, or "
                             "give the EnvironmentTask demonstration_turns")
        return [record[self.solution_field]]

    def check_startup(self) -> None:
        """Refuses the task on its own (not inside an EnvironmentTask) where it has no reward or a prompt is chat
        messages, which only an EnvironmentTask's chat template renders."""
        if self.reward_fn is None:
            raise ValueError("DatasetTask has no reward of its own: give it reward_fn, or make it the task of a "
                             "lit_cancel.agents.EnvironmentTask whose reward_funcs or environment score the episodes")
        for split, records in (("train", self._train), ("val", self._val)):
            for index, record in enumerate(records):
                if isinstance(record["prompt"], list):
                    raise ValueError(f"DatasetTask: the prompt of {split} record {index} ({self.record_source(split, index)}) "
                                     "is a list of chat messages; make the task that of a lit_cancel.agents.EnvironmentTask "
                                     "with a chat_template, which renders them")

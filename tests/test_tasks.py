import json

import pytest

from lit_cancel.tasks import AdditionTask, DatasetTask, MathWordTask, ScaffoldedAdditionTask, final_number_reward, parse_final_number


@pytest.fixture(scope="module")
def task():
    return AdditionTask(num_digits=3, train_size=50, val_size=10, seed=1)


def test_addition_verifier_on_hand_written_completions(task):
    record = {"prompt": "047+385=", "a": 47, "b": 385, "answer": "432"}
    assert task.reward(record, "7+5+0=12,4+8+1=13,0+3+1=4|432") == 1.0
    assert task.reward(record, "|432") == 1.0  # only the final answer is verified
    assert task.reward(record, "7+5+0=12,4+8+1=13,0+3+1=4|433") == 0.0  # wrong
    assert task.reward(record, "7+5+0=12,4+8+1=13,0+3+1=4|") == 0.0  # no answer
    assert task.reward(record, "7+5+0=12,4+8+1=13|43a") == 0.0  # malformed
    assert task.reward(record, "432") == 0.0  # missing the '|' marker
    assert task.reward(record, "") == 0.0


def digits_reward(record: dict, completion: str) -> float:
    """Partial credit: the share of the answer's digits written at their place after the last ``|``."""
    written = completion.rsplit("|", 1)[-1]
    return sum(a == b for a, b in zip(written, record["answer"])) / len(record["answer"])


def test_addition_correctness_is_the_exact_answer_whatever_the_reward():
    record = {"prompt": "047+385=", "a": 47, "b": 385, "answer": "432"}
    completions = ["7+5+0=12,4+8+1=13,0+3+1=4|432", "|433", "|0432", "432", ""]
    shaped = AdditionTask(num_digits=3, train_size=50, val_size=10, seed=1, reward_fn=digits_reward)
    # "0432" is 432 but shifted under the digit reward; "432" scores in full without the "|" it needs to be correct
    assert [shaped.reward(record, c) for c in completions] == pytest.approx([1.0, 2 / 3, 0.0, 1.0, 0.0])
    assert [shaped.correct(record, c) for c in completions] == [True, False, True, False, False]
    plain = AdditionTask(num_digits=3, train_size=50, val_size=10, seed=1)
    assert [plain.reward(record, c) for c in completions] == [1.0, 0.0, 1.0, 0.0, 0.0]
    scaffolded = ScaffoldedAdditionTask(train_size=10, val_size=2, reward_fn=digits_reward)
    record = scaffolded.train_records()[0]
    solution = scaffolded.solutions(record)[0]
    assert scaffolded.correct(record, solution) and scaffolded.reward(record, solution) == 1.0
    wrong = solution[:-1] + ("1" if solution[-1] == "0" else "0")  # the last digit off
    assert not scaffolded.correct(record, wrong) and scaffolded.reward(record, wrong) == pytest.approx(2 / 3)


def test_math_word_correctness_is_the_final_number_whatever_the_reward(gsm8k_file):
    task = MathWordTask(train_file=gsm8k_file, val_size=2, reward_fn=lambda record, completion: float(len(completion)))
    record = task.train_records()[0]  # 1 + 2 = 3
    assert task.correct(record, " 1+2=3. #### 3") and task.reward(record, " 1+2=3. #### 3") == 14.0
    assert task.correct(record, " so 3") and not task.correct(record, " 3 or 4") and not task.correct(record, "")


def test_addition_solutions_are_correct_and_equivalent(task):
    record = {"prompt": "047+385=", "a": 47, "b": 385, "answer": "432"}
    solutions = task.solutions(record)
    assert solutions[0] == "7+5+0=12,4+8+1=13,0+3+1=4|432"
    assert "5+7+0=12,8+4+1=13,3+0+1=4|432" in solutions
    assert len(solutions) == len(set(solutions)) == 8
    assert all(task.reward(record, s) == 1.0 for s in solutions)
    # equal digits give one ordering only: 1+1 has no swapped twin
    assert len(task.solutions({"prompt": "111+222=", "a": 111, "b": 222, "answer": "333"})) == 8
    assert len(task.solutions({"prompt": "111+111=", "a": 111, "b": 111, "answer": "222"})) == 1


def test_addition_splits_are_disjoint_and_deterministic(task):
    again = AdditionTask(num_digits=3, train_size=50, val_size=10, seed=1)
    assert task.train_records() == again.train_records()
    train = {r["prompt"] for r in task.train_records()}
    val = {r["prompt"] for r in task.val_records()}
    assert len(train) == 50 and len(val) == 10 and not train & val
    assert all(len(r["prompt"]) == 8 for r in task.train_records())


def test_addition_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="at most 50 distinct"):
        AdditionTask(num_digits=1, train_size=60, val_size=10)


def test_final_number_parsing():
    assert parse_final_number("She has 3 then 1,234 apples.\n#### 1,234") == 1234
    assert parse_final_number("first 2 then -7.5") == -7.5
    assert parse_final_number("no number here") is None
    record = {"answer_number": 42.0}
    assert final_number_reward(record, " so the answer is 42") == 1.0
    assert final_number_reward(record, " 42 or maybe 41") == 0.0
    assert final_number_reward(record, "") == 0.0


def test_math_word_task_reads_jsonl(gsm8k_file):
    task = MathWordTask(train_file=gsm8k_file, val_size=2)
    assert len(task.train_records()) == 10 and len(task.val_records()) == 2
    record = task.train_records()[0]
    assert record["prompt"] == "Question: Tom has 1 apples and buys 2 more. How many now?\nAnswer:"
    assert record["answer_number"] == 3
    assert task.reward(record, " 1+2=3. #### 3") == 1.0
    assert task.reward(record, " 4") == 0.0


def test_math_word_task_reads_parquet(tmp_path, gsm8k_file):
    import datasets

    path = tmp_path / "rows.parquet"
    datasets.load_dataset("json", data_files=gsm8k_file, split="train").to_parquet(str(path))
    assert len(MathWordTask(train_file=str(path), val_size=2).train_records()) == 10


def test_math_word_task_names_missing_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl' has no field 'question'.*fields: \['problem', 'answer'\]"):
        MathWordTask(train_file=str(path), val_file=str(path))


def test_math_word_task_names_bad_row_by_its_file_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n\n" + json.dumps({"question": "q", "answer": "two"}) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl' line 3 field 'answer' is 'two'.*'#### <number>'"):
        MathWordTask(train_file=str(path), val_file=str(path))


def test_math_word_task_names_a_byte_that_is_not_utf8_with_its_line_and_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(ValueError) as refusal:
        MathWordTask(train_file=str(path), val_file=str(path))
    assert str(refusal.value) == (
        f"MathWordTask: data file '{path}' line 3 is not UTF-8 (byte 0xe9 at column 18); save the file as UTF-8"
    )


def test_records_know_their_file_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(3)]
    path.write_text(rows[0] + "\n\n" + rows[1] + "\n" + rows[2] + "\n")
    task = MathWordTask(train_file=str(path), val_size=1)
    assert [task.record_source("train", i) for i in range(2)] == [f"'{path}' line 1", f"'{path}' line 3"]
    assert task.record_source("val", 0) == f"'{path}' line 4"


def test_math_word_task_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl' does not exist"):
        MathWordTask(train_file=str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("empty.jsonl", "", "is empty; expected one JSON object per line"),
        ("blank.jsonl", "\n\n", "is empty; expected one JSON object per line"),
        ("rows.jsonl", '{"question": "q", "answer": "#### 1"}\n\n{"question": "q" "answer": "#### 2"}\n',
         "line 3 is not valid JSON (Expecting ',' delimiter at column 18); expected one JSON object per line"),
        ("rows.json", '[{"question": "q", "answer": "#### 1"},\n {"question": "q", "answer": "#### 2"]', "is not valid JSON: line 2 column 38: Expecting ',' delimiter"),
        ("rows.json", "[]", "holds an empty list; expected a list of JSON objects"),
    ],
)
def test_math_word_task_names_unreadable_file(tmp_path, name, text, reason):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as refusal:
        MathWordTask(train_file=str(path), val_file=str(path))
    assert str(refusal.value) == f"MathWordTask: data file {str(path)!r} {reason}"


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("arrays.jsonl", '["q", "#### 1"]\n["q", "#### 2"]\n',
         "line 1 is a JSON array, not an object; expected JSON objects with the fields 'question' and 'answer'"),
        ("rows.jsonl", '{"question": "q", "answer": "#### 1"}\n\n7\n',
         "line 3 is a JSON number, not an object; expected JSON objects with the fields 'question' and 'answer'"),
        ("rows.json", '[{"question": "q", "answer": "#### 1"}, ["q", "#### 2"]]',
         "row 2 is a JSON array, not an object; expected JSON objects with the fields 'question' and 'answer'"),
    ],
)
def test_math_word_task_names_a_row_that_is_not_an_object(tmp_path, name, text, reason):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as refusal:
        MathWordTask(train_file=str(path), val_file=str(path))
    assert str(refusal.value) == f"MathWordTask: data file {str(path)!r} {reason}"


@pytest.mark.parametrize("questions", [[5, 6], ["what is 2+3?", 6], ["what is 2+3?", ""]])
def test_math_word_task_names_a_question_that_is_not_text(tmp_path, questions):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": question, "answer": "#### 5"}) + "\n" for question in questions))
    bad = next(number for number, question in enumerate(questions, start=1) if not (isinstance(question, str) and question))
    with pytest.raises(ValueError) as refusal:
        MathWordTask(train_file=str(path), val_file=str(path))
    assert str(refusal.value) == f"MathWordTask: '{path}' line {bad} field 'question' is {questions[bad - 1]!r}; expected non-empty text"


def test_math_word_task_says_a_folder_is_a_folder(tmp_path):
    with pytest.raises(ValueError) as refusal:
        MathWordTask(train_file=str(tmp_path))
    assert str(refusal.value) == f"MathWordTask: data file {str(tmp_path)!r} is a folder; name a .jsonl, .json or .parquet file in it"


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_dataset_task_reads_trl_rows_as_they_are_prompts_of_text_or_chat_messages(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rows = [{"prompt": messages, "answer": "4", "tags": ["easy"]}, {"prompt": "3+3=", "answer": "6", "tags": []},
            {"prompt": "5+5=", "answer": "10", "tags": ["easy", "even"]}]
    task = DatasetTask(write_rows(tmp_path / "rows.jsonl", rows), val_size=1)
    assert task.train_records() == rows[:2] and task.val_records() == rows[2:]
    assert task.record_source("val", 0) == f"{str(tmp_path / 'rows.jsonl')!r} line 3"
    # no reward of its own: what an EnvironmentTask's reward functions leave unscored gets 0
    assert task.reward(rows[1], "6") == 0.0 and task.correct(rows[1], "6") is None
    with pytest.raises(ValueError, match="^DatasetTask has no solutions: set solution_field"):
        task.solutions(rows[1])
    scored = DatasetTask(write_rows(tmp_path / "rows.jsonl", rows), val_size=1, solution_field="answer",
                         reward_fn=lambda record, completion: float(completion == record["answer"]))
    assert scored.solutions(rows[1]) == ["6"] and scored.reward(rows[1], "6") == 1.0


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "1+1="}, {"prompt": 7}], "{path!r} line 2 field 'prompt' is 7; expected non-empty text or a list of chat "
     "messages ([{{'role': 'user', 'content': ...}}, ...])"),
    ([{"prompt": "1+1="}, {"prompt": " "}], "{path!r} line 2 field 'prompt' is ' '; expected non-empty text or a list of "
     "chat messages ([{{'role': 'user', 'content': ...}}, ...])"),
    ([{"question": "1+1="}, {"question": "2+2="}], "data file {path!r} has no field 'prompt' (fields: ['question']); expected "
     "rows with a 'prompt', text or a list of chat messages, as TRL's datasets have"),
])
def test_a_dataset_task_names_the_line_of_a_prompt_it_cannot_use(tmp_path, rows, message):
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError) as refusal:
        DatasetTask(path, val_file=path)
    assert str(refusal.value) == "DatasetTask: " + message.format(path=path)


def test_a_dataset_task_on_its_own_needs_a_reward_and_prompts_of_text(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": [{"role": "user", "content": "2+2?"}]}])
    with pytest.raises(ValueError, match="^DatasetTask has no reward of its own: give it reward_fn, or make it the task of a "
                                         "lit_cancel.agents.EnvironmentTask"):
        DatasetTask(path, val_file=path).check_startup()
    with pytest.raises(ValueError) as refusal:
        DatasetTask(path, val_file=path, reward_fn=final_number_reward).check_startup()
    assert str(refusal.value) == (f"DatasetTask: the prompt of train record 1 ({path!r} line 2) is a list of chat messages; make "
                                  "the task that of a lit_cancel.agents.EnvironmentTask with a chat_template, which renders them")

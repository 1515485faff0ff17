"""Every YAML snippet in docs/*.md and README.md parses, and builds as a config the way ``lit-cancel fit --print_config``
builds it: a snippet is a part of a config, put where its first key says (``objective:`` under ``model.init_args``,
``task:`` under ``data.init_args``, ...) in a shipped recipe, and every value it sets is in the config printed.

The classes the snippets name in ``my_package`` are the docs' own Python examples (``my_package`` below), and
``my_rewards.partial_credit`` a reward function of that shape."""

import re
import sys
import types
from pathlib import Path

import lightning as L
import pytest
import yaml

from lit_cancel.run.cli import run_cli

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs"
DOCUMENTS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def python_blocks(document: str, heading: str) -> str:
    """The Python blocks of ``document``'s section ``heading`` (up to the next heading of its level), joined."""
    text = (ROOT / document).read_text()
    level = re.search(rf"^(#+) {re.escape(heading)}$", text, re.M)
    assert level, f"{document} has no section {heading!r}"
    section = re.split(rf"^{level[1]} ", text[level.end():], maxsplit=1, flags=re.M)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))


def docs_module(name: str, sources: list[tuple[str, str]]) -> types.ModuleType:
    """A module ``name`` made of the docs' Python blocks ``(document, heading)``, as a user's package on the path."""
    module = types.ModuleType(name)
    for document, heading in sources:
        exec(compile(python_blocks(document, heading), document, "exec"), module.__dict__)
    return module


@pytest.fixture
def my_package(monkeypatch):
    """``my_package``: the task of docs/tasks.md's "A task of your own", the environments of docs/agents.md's "Writing an
    environment" (its own, and TRL's with a reward function, in "Environments from TRL"); ``my_rewards.partial_credit``."""
    package = docs_module("my_package", [("docs/tasks.md", "A task of your own"), ("docs/agents.md", "Writing an environment")])
    rewards = types.ModuleType("my_rewards")
    rewards.partial_credit = lambda record, completion: float(completion.endswith(record["prompt"][:1]))
    monkeypatch.setitem(sys.modules, "my_package", package)
    monkeypatch.setitem(sys.modules, "my_rewards", rewards)
    return package


def yaml_snippets() -> list:
    snippets = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in re.finditer(r"```ya?ml\n(.*?)```", text, re.S):
            line = text[:match.start()].count("\n") + 1
            snippets.append(pytest.param(match[1], id=f"{document.relative_to(ROOT)}:{line}"))
    return snippets


def placed(snippet) -> tuple[list, str]:
    """Where a snippet goes in a config, and the recipe it goes into: the keys above it, by its first key."""
    if isinstance(snippet, list):
        return ["trainer", "callbacks"], "quickstart.yaml"
    first = next(iter(snippet))
    if first in ("trainer", "model", "data", "seed_everything"):
        return [], "quickstart.yaml"
    if first in ("objective", "engine"):
        return ["model", "init_args"], "quickstart.yaml"
    if first == "task":
        return ["data", "init_args"], "quickstart.yaml"
    if first == "class_path":  # a task's class and options
        return ["data", "init_args", "task"], "quickstart.yaml"
    # an option of an EnvironmentTask whose environment is TRL's
    return ["data", "init_args", "task", "init_args"], "trl-environment.yaml"


def merged(base, part):
    """``part`` over ``base``: a mapping naming a class_path replaces the base's, others merge key by key."""
    if not isinstance(base, dict) or not isinstance(part, dict) or "class_path" in part:
        return part
    return {**base, **{key: merged(base.get(key), value) for key, value in part.items()}}


def leaves(value, path=()):
    """``(path, value)`` of every value ``value`` sets, but class paths (the printed config may spell them longer)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "class_path":
                yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path, value


def test_every_document_s_yaml_snippets_are_found():
    names = [snippet.id.split(":")[0] for snippet in yaml_snippets()]
    assert "docs/agents.md" in names and "docs/tasks.md" in names and "docs/objectives.md" in names


@pytest.mark.parametrize("text", yaml_snippets())
def test_every_yaml_snippet_in_the_docs_builds_as_a_config(text, my_package, tmp_path, capsys):
    snippet = yaml.safe_load(text)
    assert isinstance(snippet, dict | list) and snippet, "a snippet is a part of a config"
    above, recipe = placed(snippet)
    part = snippet
    for key in reversed(above):
        part = {key: part}
    config = merged(yaml.safe_load((CONFIGS / recipe).read_text()), part)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as printed:
        run_cli(["fit", "--config", str(path), "--print_config"])
    assert printed.value.code in (None, 0)
    built = yaml.safe_load(capsys.readouterr().out)
    for keys, value in leaves(part):
        found = built
        for key in keys:
            found = found[key]
        if isinstance(found, dict) and list(found) == ["class_path"]:  # a class or function given by its import path
            found = found["class_path"]
        assert found == value, f"{'.'.join(map(str, keys))}: the snippet sets {value!r}, the config built has {found!r}"


class Trained(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def test_the_task_of_the_docs_is_what_they_say_and_trains_through_the_cli(my_package, tmp_path):
    task = my_package.MyTask(train_size=40, val_size=8)
    record = task.train_records()[0]
    assert record["answer"] == "".join(sorted(record["prompt"].rstrip(">"))) and len(record["answer"]) == 6
    assert {r["prompt"] for r in task.train_records()}.isdisjoint(r["prompt"] for r in task.val_records())
    assert task.reward(record, task.solutions(record)[0]) == 1.0 and task.reward(record, "9") == 0.0
    assert task.correct(record, record["answer"]) and not task.correct(record, "9")
    cli = run_cli([
        "fit", "--config", str(CONFIGS / "sft-tiny.yaml"), "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--model.init_args.output_dir=null",
        "--model.init_args.max_new_tokens=8", "--model.init_args.val_samples=1", "--data.init_args.batch_size=8",
        "--data.init_args.val_batch_size=4", "--data.init_args.task=my_package.MyTask",
        "--data.init_args.task.init_args.train_size=40", "--data.init_args.task.init_args.val_size=8",
        "--trainer.callbacks+=test_docs.Trained", f"--trainer.default_root_dir={tmp_path}",
    ])
    assert cli.trainer.global_step == 2
    [trained] = [callback for callback in cli.trainer.callbacks if isinstance(callback, Trained)]
    tokenizer = cli.model.tokenizer
    for ids, labels in zip(trained.batches[0]["input_ids"].tolist(), trained.batches[0]["labels"].tolist()):
        prompt = tokenizer.decode(ids[:7])
        # what trains is the task's solution of the prompt and its stop token
        assert [label for label in labels if label != -100] == tokenizer("".join(sorted(prompt[:6])))["input_ids"] + [
            tokenizer.eos_token_id]

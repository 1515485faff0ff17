import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_callback_example_runs_and_cancels(capsys):
    section = README.read_text().split("## Use the callbacks in your own Lightning project", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README example", "exec"), namespace)
    assert namespace["monitors"][1].last_tax == 0.0
    assert namespace["monitors"][0].baseline is not None
    assert capsys.readouterr().out.strip().endswith("0.0")


def test_readme_states_the_commands():
    text = README.read_text()
    for command in ['pip install -e ".[dev]"', "lit-cancel fit --config configs/quickstart.yaml", "pytest"]:
        assert command in text

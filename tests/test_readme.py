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


def command_lines(text: str) -> list[str]:
    """The ``pip`` lines of a shell text, without their comments."""
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip().startswith("pip ")]


def test_ci_installs_with_exactly_the_readme_lines():
    readme = command_lines("\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)))
    ci = command_lines((README.parent / ".ci" / "run").read_text())
    # the README's lines for a CPU, in the README's order, each environment from its torch line on
    cpu_lines = [line for line in readme if line != 'pip install -e ".[vllm]"']
    assert ci == cpu_lines
    assert ci.count("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu") == 2

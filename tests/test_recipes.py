"""The multi-node recipes in examples/: every ``lit-cancel`` command of the scripts parses with the options it uses,
the launchers start as many processes as the trainer expects, and the server configs parse without vLLM (those that
launch a server here say how to install it)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from lit_cancel import VLLMServerEngine
from lit_cancel.run.cli import run_cli
from lit_cancel.run.errors import ConfigError
from lit_cancel.run.serve import parser as serve_parser

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
ROOT = Path(__file__).parents[1]
SCRIPTS = {
    "slurm": ROOT / "examples" / "slurm" / "rl_with_vllm_servers.sbatch",
    "torchrun": ROOT / "examples" / "torchrun" / "rl_with_vllm_servers.sh",
}
# what the scripts learn only when they run, as a job of two 8-GPU trainer nodes and one server node has it
RUN_TIME = {
    "USER": "alice",
    "SLURM_JOB_ID": "81234",
    "SLURM_LOCALID": "3",
    "SLURM_CPUS_PER_TASK": "8",
    "gpu": "3",
    "SERVER_NODES": "1",
    "TRAIN_HOSTS": "gpu-01,gpu-02",
    "SERVER_HOSTS": "gpu-03",
    "URL_LIST": '["http://gpu-03:8000", "http://gpu-03:8001"]',
}
SHELL_OPERATORS = set("();<>|&")


def script_values(text: str) -> dict[str, str]:
    """The script's own variables (``NAME=${NAME:-default}`` gives the default), under RUN_TIME's."""
    values = {}
    for name, value in re.findall(r"^([A-Za-z_]\w*)=(\S+)", text, re.M):
        if "$(" not in value:
            values[name] = re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", value)
    return values | RUN_TIME


def expand(word: str, values: dict[str, str]) -> str:
    """``word`` with its ``$NAME`` and ``${NAME}`` replaced; KeyError for a variable with no value here."""

    def value(match: re.Match) -> str:
        if match[1] not in values:
            raise KeyError(f"${match[1]} has no value: give it one in RUN_TIME")
        return expand(values[match[1]], values)

    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", value, word)


def arithmetic(line: str, values: dict[str, str]) -> str:
    """``line`` with each ``$((...))`` replaced by its value."""

    def evaluate(match: re.Match) -> str:
        expression = re.sub(r"[A-Za-z_]\w*", lambda name: expand("$" + name[0], values), match[1])
        return str(eval(expression, {"__builtins__": {}}))  # digits and + - * / % only, from the scripts above

    return re.sub(r"\$\(\((.*?)\)\)", evaluate, line)


def words(line: str) -> list[str]:
    """The shell words of ``line``, quotes removed, operators (``>``, ``&``, ``;``) as words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def logical_lines(text: str) -> list[str]:
    """The commands of a script: continued lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", " ").splitlines()


def commands(script: Path, name: str) -> list[tuple[list[str], list[str]]]:
    """Each ``lit-cancel NAME`` command of ``script`` (also one inside ``bash -c '...'``): the words before it on its
    line (its launcher, e.g. ``srun ...``) and its arguments, shell variables replaced."""
    text = script.read_text()
    values = script_values(text)

    def found_in(line: str) -> list[tuple[list[str], list[str]]]:
        found, line_words = [], words(arithmetic(line, values))
        for index, word in enumerate(line_words):
            if word != "lit-cancel" and f"lit-cancel {name}" in word:
                found += found_in(word)
            elif word == "lit-cancel" and line_words[index + 1 : index + 2] == [name]:
                arguments = []
                for argument in line_words[index + 2 :]:
                    if set(argument) <= SHELL_OPERATORS:
                        break
                    arguments.append(expand(argument, values))
                launcher = [expand(w, values) for w in line_words[:index]]
                found.append((launcher, arguments))
        return found

    return [command for line in logical_lines(text) if f"lit-cancel {name}" in line for command in found_in(line)]


def printed_config(arguments: list[str], capsys) -> dict:
    """The whole config that ``lit-cancel fit ARGUMENTS --print_config`` prints: parsed, nothing built or run."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as printed:
        run_cli(["fit", *arguments, "--print_config"])
    assert printed.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)


def serve_options(arguments: list[str]):
    """``lit-cancel serve``'s options; ValueError naming the words it does not know (it would pass them to vLLM)."""
    options, unknown = serve_parser().parse_known_args(arguments)
    if unknown:
        raise ValueError(f"lit-cancel serve does not know {unknown}")
    return options


def option(arguments: list[str], name: str) -> str:
    return arguments[arguments.index(name) + 1]


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_the_scripts_are_valid_bash(script):
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_every_fit_line_parses_and_builds_a_server_engine(script, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the scripts run from the repository's root
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM fails, as on a trainer without it
    fits = commands(script, "fit")
    assert fits, f"{script.name} has no lit-cancel fit line"
    for _, arguments in fits:
        config = printed_config(arguments, capsys)
        engine = config["model"]["init_args"]["engine"]
        assert engine["class_path"] == "lit_cancel.VLLMServerEngine"
        assert engine["init_args"]["urls"] == json.loads(RUN_TIME["URL_LIST"])  # a list, not one string
        assert engine["init_args"]["weights_dir"].startswith("/shared/alice/lit-cancel/")
        world = int(config["trainer"]["num_nodes"]) * int(config["trainer"]["devices"])  # devices stays "8", which Lightning reads
        assert world == 16
        assert config["data"]["init_args"]["prompts_per_round"] % world == 0  # else the run stops at start-up
        built = VLLMServerEngine(**engine["init_args"])
        assert built.urls == json.loads(RUN_TIME["URL_LIST"]) and not built.launch


def test_a_misspelt_option_in_a_fit_line_is_refused(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    _, arguments = commands(SCRIPTS["slurm"], "fit")[0]
    misspelt = [a.replace("engine.init_args.urls", "engine.init_args.url") for a in arguments]
    assert misspelt != arguments
    with pytest.raises(ConfigError, match="has no option 'url'"):
        run_cli(["fit", *misspelt, "--print_config"])
    with pytest.raises(KeyError, match="NOT_SET"):
        expand("$NOT_SET/weights", RUN_TIME)  # a variable the test cannot give a value fails, not passes


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_every_serve_line_parses_and_serves_the_trainers_config(script):
    serves, fits = commands(script, "serve"), commands(script, "fit")
    assert serves, f"{script.name} has no lit-cancel serve line"
    for _, arguments in serves:
        options = serve_options(arguments)
        assert options.host == "0.0.0.0"  # reachable from the trainer's machines
        assert options.port == 8003  # BASE_PORT + the GPU it serves on
        assert (ROOT / options.config).is_file()
        assert all(option(fit, "--config") == options.config for _, fit in fits)  # the servers serve the trained model


def test_a_misspelt_serve_option_is_refused():
    _, arguments = commands(SCRIPTS["torchrun"], "serve")[0]
    with pytest.raises(ValueError, match="--prot"):
        serve_options([a.replace("--port", "--prot") for a in arguments])
    with pytest.raises(ConfigError, match="the following arguments are required: --config"):
        serve_options(arguments[2:])  # without --config


def test_every_srun_step_gets_the_jobs_cpus_per_task():
    # since Slurm 22.05 srun does not inherit the batch job's --cpus-per-task: a step without it gives each task one CPU
    text = SCRIPTS["slurm"].read_text()
    (cpus,) = re.findall(r"^#SBATCH --cpus-per-task=(\d+)$", text, re.M)
    steps = [words(line) for line in logical_lines(text) if line.lstrip().startswith("srun ")]
    assert len(steps) == 2  # the servers and the trainer
    for step in steps:
        given = [word.split("=", 1)[1] for word in step if word.startswith("--cpus-per-task=")]
        assert [expand(value, {"SLURM_CPUS_PER_TASK": cpus}) for value in given] == [cpus], step[:6]


def test_the_launchers_start_the_processes_the_trainer_expects():
    # SLURMEnvironment refuses a step whose --nodes or --ntasks-per-node differ from num_nodes and devices
    (srun, fit), = commands(SCRIPTS["slurm"], "fit")
    assert srun[0] == "srun"
    launched = dict(word[2:].split("=", 1) for word in srun if word.startswith("--") and "=" in word)
    assert launched["nodes"] == option(fit, "--trainer.num_nodes") == "2"
    assert launched["ntasks-per-node"] == option(fit, "--trainer.devices") == "8"
    # TorchElasticEnvironment refuses a world size other than num_nodes x devices
    (torchrun, fit), = commands(SCRIPTS["torchrun"], "fit")
    assert torchrun[0] == "torchrun"
    launched = get_args_parser().parse_args([*torchrun[1:], "lit-cancel", "fit", *fit])
    assert launched.no_python and launched.training_script == "lit-cancel" and launched.training_script_args[0] == "fit"
    assert launched.nnodes == option(fit, "--trainer.num_nodes") == "2"
    assert launched.nproc_per_node == option(fit, "--trainer.devices") == "8"


SERVER_CONFIGS = ["quickstart-server.yaml", "quickstart-async.yaml", "qwen2.5-0.5b-gsm8k-server.yaml"]


@pytest.mark.parametrize("name", SERVER_CONFIGS)
def test_server_configs_parse_without_vllm_and_those_that_launch_a_server_say_how_to_install_it(name, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    config = printed_config(["--config", str(ROOT / "configs" / name)], capsys)
    engine = config["model"]["init_args"]["engine"]
    assert engine["class_path"] == "lit_cancel.VLLMServerEngine"
    if engine["init_args"].get("launch"):  # the quickstarts start their server here, which needs vLLM
        with pytest.raises(ImportError, match=r"launch: true starts a vLLM server here, and vLLM is not installed: on a CPU"):
            VLLMServerEngine(**engine["init_args"])
        return
    built = VLLMServerEngine(**engine["init_args"])
    assert not built.launch and built.max_staleness == 1

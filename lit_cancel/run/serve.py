"""``lit-cancel serve --config CONFIG``: a vLLM rollout server for a config's model, for ``VLLMServerEngine``'s ``urls``;
``fit``'s overrides of the model (``--model.init_args.model_path PATH``, ``--model.init_args.engine.init_args.NAME VALUE``)
apply to it as they do to ``fit``'s, so that the server serves what ``fit`` trains.

Every mistake in the options, the config or its model is refused in one line before anything is started
(:class:`ServeSetup`); then this process becomes vLLM's server on the config's model folder, read where it lies
(:func:`~lit_cancel.engines.server_process.server_command`).
"""

import argparse
import importlib.util
import json
import os
import socket
from pathlib import Path

from lit_cancel.engines.server_process import server_command, server_environment
from lit_cancel.run.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are raised (as ``lit-cancel fit`` reports them) instead of printed with its usage."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message}")


def parser() -> argparse.ArgumentParser:
    """The options of ``lit-cancel serve``; the arguments it does not know are passed on to vLLM's server."""
    parser = _Parser(
        prog="lit-cancel serve", description="Start a vLLM rollout server for a config's model (VLLMServerEngine's urls). "
        "--model.init_args.NAME VALUE options change the config's model as in lit-cancel fit; any other option is vLLM's "
        "server's, passed on to it.",
    )
    parser.add_argument("--config", required=True, help="the fit config whose model (model_path, dtype) is served, with the "
                        "max_model_len, kv_cache_memory_bytes and dtype of its engine unless given here")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cpus", default=None, help="comma-separated CPU cores for the server (a CPU server), e.g. 1")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus completion; default: the config's, else the model's")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size; default: the config's, else 1 GiB on a CPU and a share of memory on a GPU")
    parser.add_argument("--dtype", default=None, help="the server's dtype; default: the config's, else the model's (bfloat16 on a GPU)")
    return parser


def read_config(path: str) -> dict:
    """The fit config file ``path`` as a mapping; ValueError in one line naming the file when it cannot be."""
    import yaml

    config = Path(path)
    if config.is_dir():
        raise ValueError(f"--config {path} is a folder: name a fit config file, e.g. configs/quickstart.yaml")
    try:
        content = yaml.safe_load(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path} does not exist: name a fit config file, e.g. configs/quickstart.yaml") from None
    except OSError as error:
        raise ValueError(f"--config {path} cannot be read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path} is not a text file: name a fit config file (YAML)") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        raise ValueError(f"--config {path} line {mark.line + 1} column {mark.column + 1}: {error.problem or error.context}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path} is not valid YAML: {error}") from None
    if content is None:
        raise ValueError(f"--config {path} is empty: it must hold a fit config (model:, trainer:, data:)")
    if not isinstance(content, dict):
        raise ValueError(f"--config {path} must hold a mapping (model:, trainer:, data:), not a {type(content).__name__}")
    return content


def split_model_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` as ``lit-cancel fit``'s overrides of the config's model (``--model.init_args.NAME=VALUE`` or
    ``--model.init_args.NAME VALUE``, also into the engine's: ``--model.init_args.engine.init_args.NAME``), each as
    ``OPTION=VALUE``, and the other arguments; ValueError in one line for an override without a value."""
    overrides, others, words = [], [], iter(args)
    for word in words:
        if not word.startswith("--model."):
            others.append(word)
            continue
        if "=" not in word:
            value = next(words, None)
            if value is None or value.startswith("--"):
                raise ValueError(f"{word}: expected a value, e.g. {word}=VALUE")
            word = f"{word}={value}"
        overrides.append(word)
    return overrides, others


def overridden_model(model: dict, overrides: list[str]) -> dict:
    """The config's ``model`` section with ``overrides`` applied as ``lit-cancel fit`` applies them (jsonargparse, by
    the signatures of the classes the config names); ValueError in one line naming the option, as ``fit`` would, for an
    option those classes do not have or a value of the wrong type."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    from lit_cancel.run.errors import explain

    model_parser = ArgumentParser(exit_on_error=False)
    model_parser.add_subclass_arguments(LightningModule, "model", fail_untyped=False, required=True)
    try:
        parsed = model_parser.parse_args([f"--model={json.dumps(model, default=str)}", *overrides])
    except argparse.ArgumentError as error:
        raise ValueError(explain(error)) from None
    return parsed.as_dict()["model"]


class ServeSetup:
    """What ``lit-cancel serve ARGV`` runs, checked before anything is started, in the order :func:`main` calls:
    the options and the config file (here), what vLLM would refuse only once started (:meth:`check_with_vllm`), the model
    and the KV cache it needs (:meth:`load`); then :meth:`command` is the server's command line. Each check raises
    ValueError in one line.

    The config's model is the config file's with ``fit``'s overrides of it applied (:func:`overridden_model`). Each server
    setting comes from the command line, else from the config's engine, else its default; the option or config key that
    gave it is kept, for the messages.
    """

    def __init__(self, argv: list[str]):
        args, extra = parser().parse_known_args(argv)
        overrides, self.extra = split_model_overrides(extra)
        self.host, self.port = args.host, args.port
        self.config = " ".join([args.config, *overrides])  # the config file and the overrides of it, for the messages
        model = read_config(args.config).get("model") or {}
        if overrides:
            model = overridden_model(model, overrides)
        self.arguments = model.get("init_args") or {}
        engine = self.arguments.get("engine")
        self.engine = (engine.get("init_args") or {}) if isinstance(engine, dict) else {}
        self.cpus = _cores(args.cpus)
        engine_key = f"{self.config}: model.init_args.engine.init_args"
        self.kv_cache, self.kv_cache_option = _setting(
            args.kv_cache_memory_bytes, "--kv-cache-memory-bytes", self.engine.get("kv_cache_memory_bytes"),
            f"{engine_key}.kv_cache_memory_bytes",
        )
        self.max_model_len, self.max_model_len_option = _setting(
            args.max_model_len, "--max-model-len", self.engine.get("max_model_len"), f"{engine_key}.max_model_len"
        )
        self.dtype = args.dtype or self.engine.get("dtype")
        self.model_path = self.arguments.get("model_path", "embedded:tiny-adder")
        self._check_model()
        self.vllm_options: dict = {}
        self.adapter_args: list[str] = []  # a LoRA run's adapters are loaded at run time
        self.model = self.tokenizer = None
        self.on_cpu = True

    def _check_model(self) -> None:
        """Refuses a model folder that is not there, and a dtype torch does not know, without loading the model."""
        import torch

        from lit_cancel.hub import resolve_model_path

        try:
            resolve_model_path(self.model_path, option="model.init_args.model_path")
        except FileNotFoundError as error:
            raise ValueError(f"--config {self.config}: {error}") from None
        for key, dtype in [("model.init_args.dtype", self.arguments.get("dtype")), ("the server's dtype", self.dtype)]:
            if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"--config {self.config}: {key}={dtype!r} is not a torch dtype, e.g. bfloat16 or float32")

    def check_with_vllm(self) -> None:
        """Refuses what vLLM would refuse only once it started: a missing vLLM, options of vLLM's that it does not know or
        accept, an address it cannot listen at."""
        from lit_cancel.engines.vllm_common import INSTALL_LINES, quiet_vllm_start_up

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"lit-cancel serve runs vLLM's server, and vLLM is not installed here: {INSTALL_LINES}")
        quiet_vllm_start_up()
        self.vllm_options = vars(vllm_options(["--model", "MODEL", *self.extra]))
        check_port_free(self.host, self.port)

    def load(self) -> None:
        """Loads the config's model and tokenizer; refuses a KV cache too small for one sequence on a CPU
        (:func:`~lit_cancel.engines.vllm_common.kv_cache_need`)."""
        import torch

        from lit_cancel.engines.vllm_common import CPU_KV_CACHE, engine_dtype, kv_cache_need, kv_cache_refusal
        from lit_cancel.hub import load_causal_lm, load_tokenizer

        try:
            self.model = load_causal_lm(self.model_path, dtype=self.arguments.get("dtype"), option="model.init_args.model_path")
            self.tokenizer = load_tokenizer(self.model_path, option="model.init_args.model_path")
        except (OSError, ValueError) as error:  # a folder whose weights or tokenizer do not load
            raise ValueError(f"--config {self.config}: model.init_args.model_path={self.model_path!r} does not load: "
                             f"{str(error).partition(chr(10))[0]}") from None
        self.on_cpu = not torch.cuda.is_available()
        device = torch.device("cpu" if self.on_cpu else "cuda")
        self.dtype = engine_dtype(self.dtype, next(self.model.parameters()).dtype, device)
        if self.kv_cache is None and self.on_cpu:
            self.kv_cache = CPU_KV_CACHE
        need = kv_cache_need(self.model.config, self.tokenizer, self.dtype, self.max_model_len, self.vllm_options)
        if self.on_cpu and need is not None and self.kv_cache < need[0]:
            raise ValueError(kv_cache_refusal(
                need, self.kv_cache, self.kv_cache_option is not None, self.max_model_len_option is not None,
                self.kv_cache_option or "--kv-cache-memory-bytes", self.max_model_len_option or "--max-model-len",
                self.arguments.get("max_new_tokens", 64),
            ))
        self._adapters()

    def _adapters(self) -> None:
        """With the config's LoRA pushed as adapters, the arguments that let the server load them (the trainer pushes the
        base weights once, then each version's adapter)."""
        from lit_cancel.engines.adapters import adapter_server_args, adapters_to_push
        from lit_cancel.lora import LoRA

        lora = self.arguments.get("lora")
        if not lora or not self.engine.get("push_adapters", True):
            return
        try:
            adapted = LoRA(**lora).apply(self.model)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--config {self.config}: model.init_args.lora: {error}") from None
        config = adapters_to_push(adapted, True, "model.init_args.engine.init_args.push_adapters")
        if config is not None:
            self.adapter_args = adapter_server_args(config, int(self.engine.get("max_staleness", 0)) + 1)

    def command(self) -> list[str]:
        """The server's command line: vLLM reads the config's model folder where it lies, in the server's dtype (nothing
        is copied: a copy per server would fill the temporary folder of a node that serves on 8 GPUs)."""
        from lit_cancel.hub import resolve_model_path

        folder = str(resolve_model_path(self.model_path))
        return server_command(
            folder, self.host, self.port, self.dtype, self.max_model_len, self.kv_cache, self.on_cpu, [*self.adapter_args, *self.extra]
        )


def _setting(given, option: str, configured, config_key: str) -> tuple:
    """A setting's value, and the option or config key that gave it (None: neither gave it)."""
    if given is not None:
        return given, option
    if configured is not None:
        return configured, config_key
    return None, None


def _cores(cpus: str | None) -> list[int] | None:
    """The cores of ``--cpus``; ValueError naming those this process may use when one is not a core number, or not one of them."""
    if cpus is None:
        return None
    available = sorted(os.sched_getaffinity(0))
    try:
        chosen = [int(core) for core in cpus.split(",")]
    except ValueError:
        raise ValueError(f"--cpus {cpus}: expected comma-separated core numbers, e.g. --cpus 1 or --cpus 2,3 "
                         f"(cores here: {_ranges(available)})") from None
    if missing := [core for core in chosen if core not in available]:
        raise ValueError(f"--cpus {cpus}: no core {_ranges(missing)} here; this process may use cores {_ranges(available)}")
    return chosen


def _ranges(cores: list[int]) -> str:
    """``0-3,6`` for cores 0, 1, 2, 3 and 6."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def vllm_options(args: list[str]) -> argparse.Namespace:
    """``args`` parsed as vLLM's server parses its command line; ValueError in one line (not vLLM's usage) for a mistake."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_parser = make_arg_parser(FlexibleArgumentParser(prog="vLLM's server"))

    def refuse(message: str):
        raise ValueError(f"{message.replace('unrecognized arguments', 'options neither lit-cancel serve nor vLLM knows')} "
                         "(lit-cancel serve --help lists its own; vLLM's server's: python -m vllm.entrypoints.openai.api_server --help)")

    vllm_parser.error = refuse
    options = vllm_parser.parse_args(args)
    try:
        validate_parsed_serve_args(options)
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"vLLM's server refuses its options: {str(error).strip(chr(39))}") from None
    return options


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the address when vLLM's server could not listen at ``host:port`` (taken, or not this machine's)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds
        try:
            probe.bind((host, port))
        except OverflowError:
            raise ValueError(f"--port {port}: a port is a number from 0 to 65535") from None
        except OSError as error:
            taken = error.errno == 98  # EADDRINUSE
            reason = "another process listens there (another server?): choose another --port" if taken else error.strerror
            raise ValueError(f"--host {host} --port {port}: cannot listen there, {reason}") from None


def main(argv: list[str]) -> int:
    """``lit-cancel serve --config CONFIG``: a rollout server for the config's model, in the foreground. Every mistake in
    the options, the config or its model is refused (ConfigError, one line) before anything is started."""
    try:
        setup = ServeSetup(argv)
        setup.check_with_vllm()
        setup.load()
    except ValueError as error:
        raise ConfigError(str(error)) from error
    command = setup.command()
    if setup.cpus:
        os.sched_setaffinity(0, setup.cpus)
    print(f"serving at {setup.host}:{setup.port}:\n  {' '.join(command)}", flush=True)
    os.execve(command[0], command, server_environment(setup.cpus, command))

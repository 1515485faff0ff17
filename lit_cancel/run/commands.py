"""The ``lit-cancel`` command: ``fit`` and ``validate`` (:mod:`lit_cancel.run.cli`), ``export``, ``audit-objective``,
``serve`` and ``diagnose``, each ending with a short message and an exit status of its own.

A mistake found before anything runs exits with status 2 and one line naming it; an error that stopped a started run
with status 1, naming the step and the last good checkpoint; a signal with 128 + its number. ``LIT_CANCEL_DEBUG=1``
shows the whole traceback instead.
"""

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import warnings

from lit_cancel.run.checkpointing import RunStopped
from lit_cancel.run.cli import run_cli
from lit_cancel.run.errors import ConfigError, RunError
from lit_cancel.run.flags import spelled_as_defined
from lit_cancel.run.log_errors import quiet_log_writer_threads

DEBUG_VARIABLE = "LIT_CANCEL_DEBUG"
# what each command does, as ``lit-cancel --help`` lists them
COMMAND_SUMMARIES = {
    "fit": "train a config's model with RL (--ckpt_path resumes a run)",
    "validate": "measure the held-out accuracy of a config's model, or of a checkpoint (--ckpt_path)",
    "export": "write a checkpoint as a Hugging Face folder (LoRA adapters merged)",
    "audit-objective": "measure the learning tax of an objective",
    "serve": "start a vLLM rollout server for a config's model",
    "diagnose": "name why a run is not learning, from its TensorBoard files",
}
COMMANDS = tuple(COMMAND_SUMMARIES)
# the module of each command other than fit and validate: its parser() and main(argv), which returns the exit status
COMMAND_MODULES = {
    "export": "lit_cancel.run.export",
    "audit-objective": "lit_cancel.objectives.audit",
    "serve": "lit_cancel.run.serve",
    "diagnose": "lit_cancel.callbacks.doctor.command",
}


def debugging() -> bool:
    """Whether ``LIT_CANCEL_DEBUG`` asks for whole tracebacks instead of the one-line reports."""
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """A warning as the command prints it: ``warning: message`` on one line, without the file and the source line."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"warning{kind}: {message}\n"


def quiet_dependencies() -> None:
    """Drops what the libraries under the command print on every run and that a user can do nothing about."""
    # Lightning 2.6 flattens every dataloader with torch's LeafSpec, which torch 2.13 deprecates in a FutureWarning
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    # Lightning advertises its cloud services at every Trainer it builds
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: not record.getMessage().startswith("💡 Tip"))


def parser() -> argparse.ArgumentParser:
    """What ``lit-cancel --help`` prints: the commands, each with what it does."""
    top = argparse.ArgumentParser(
        prog="lit-cancel", description="Critic-free RL fine-tuning of language models with PyTorch Lightning.",
        epilog=f"lit-cancel COMMAND --help lists the options of a command; {DEBUG_VARIABLE}=1 shows the traceback of an error.",
    )
    listed = top.add_subparsers(title="commands")
    for name, summary in COMMAND_SUMMARIES.items():
        listed.add_parser(name, help=summary)
    return top


def main() -> None:
    """The console script: LightningCLI's ``fit`` and ``validate``, ``export``, ``audit-objective``, ``serve``, ``diagnose``."""
    quiet_dependencies()
    command = sys.argv[1:2]
    excepthook, formatwarning = threading.excepthook, warnings.formatwarning
    if not debugging():
        threading.excepthook = quiet_log_writer_threads(excepthook)
        warnings.formatwarning = one_line_warning
    try:
        if not command:
            raise ConfigError(f"lit-cancel needs a command: {', '.join(COMMANDS[:-1])} or {COMMANDS[-1]} "
                              "(lit-cancel COMMAND --help lists its options)")
        if command[0] in ("-h", "--help"):
            parser().print_help()
            return
        if command[0] not in COMMANDS:
            raise ConfigError(f"unknown command {command[0]!r}: the commands are {', '.join(COMMANDS[:-1])} and {COMMANDS[-1]} "
                              "(lit-cancel COMMAND --help lists its options)")
        if command[0] in COMMAND_MODULES:
            module = importlib.import_module(COMMAND_MODULES[command[0]])
            try:
                argv = spelled_as_defined(sys.argv[2:], module.parser())
            except argparse.ArgumentTypeError as error:
                raise ConfigError(str(error)) from error
            sys.exit(module.main(argv))
        try:
            run_cli()
        except KeyboardInterrupt as stop:  # the run's own Ctrl-C is told by stops_reported: this one came before it
            raise RunStopped("stopped by Ctrl-C (SIGINT) before the run started: nothing to resume", 128 + signal.SIGINT) from stop
    except ConfigError as error:
        if debugging():
            raise
        sys.stderr.write(f"lit-cancel: nothing was run ({DEBUG_VARIABLE}=1 shows the traceback)\nerror: {error}\n")
        sys.exit(2)
    except RunError as error:
        if debugging():
            raise
        saved = f"the last good step is in {error.checkpoint}" if error.checkpoint else "no checkpoint was written"
        sys.stderr.write(
            f"lit-cancel: the run stopped at step {error.step} ({DEBUG_VARIABLE}=1 shows the traceback)\nerror: {error}\n{saved}\n"
        )
        sys.exit(1)
    except RunStopped as stop:
        if debugging():
            raise
        sys.stderr.write(f"lit-cancel: {stop}\n")
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # export, audit-objective, diagnose: nothing of theirs needs saving
        if debugging():
            raise
        sys.stderr.write(f"lit-cancel {command[0]}: stopped by Ctrl-C (SIGINT)\n")
        sys.exit(128 + signal.SIGINT)
    finally:
        threading.excepthook, warnings.formatwarning = excepthook, formatwarning

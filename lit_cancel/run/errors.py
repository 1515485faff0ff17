"""The two ways a ``lit-cancel`` command ends with a short message: a mistake found before anything runs
(:class:`ConfigError`, exit status 2), and an error that stopped a started run (:class:`RunError`, exit status 1); and
how jsonargparse's nested errors become one line naming the option (:func:`explain`)."""

import argparse
import re
from pathlib import Path

import yaml

from lit_cancel.objectives import presets
from lit_cancel.objectives.policy_gradient import Objective

# errors whose message is clear without the exception's type (jsonargparse's own, the project's checks)
_MESSAGE_SAYS_ALL = (ValueError, TypeError, OSError, LookupError, ImportError, AttributeError, argparse.ArgumentError)
# what jsonargparse says of a value it cannot use for an option typed as a Callable (a class or a function named by its
# import path), and how the message says it
_CALLABLE_PROBLEMS = (
    (r"No module named '([^']+)'", "was not found: no module named '{0}' on the Python path"),
    (r"module '([^']+)' has no attribute '([^']+)'", "was not found: module '{0}' has no attribute '{1}'"),
    (r"Expected a dot import path string", "is not an import path"),
    (r"Expected '[^']+' to be a subclass of <class '(\w+)'>", "is not a subclass of {0}"),
)
_PRESETS = [name for name, value in vars(presets).items()
            if isinstance(value, type) and issubclass(value, Objective) and value.__module__ == presets.__name__ and name[0] != "_"]


class ConfigError(Exception):
    """A mistake in the command line, the config or the files it names, found before training starts."""


class RunError(Exception):
    """A reward error, a failure budget spent, a run of non-finite steps or an I/O error that stopped a run after it started.

    The message is the cause's; ``step`` is the optimizer steps done, ``checkpoint`` the path of the
    last checkpoint the run wrote (None when it wrote none).
    """

    def __init__(self, cause: BaseException, step: int, checkpoint: str | None):
        super().__init__(str(cause))
        self.step, self.checkpoint = step, checkpoint


def config_file_problem(message: str, args: list[str]) -> str:
    """What is wrong with the config file behind a jsonargparse ``message`` that does not name it: a YAML error at its
    line and column (for ``"<unicode string>"``), or a file that is empty or not a mapping (for "Unexpected config")."""
    configs = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    configs += [b for a, b in zip(args, args[1:]) if a == "--config"]
    for config in configs:
        try:
            options = yaml.safe_load(Path(config).read_text())
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            return f"{config} line {mark.line + 1} column {mark.column + 1}: {error.problem or error.context}"
        except (OSError, yaml.YAMLError):
            continue
        if options is None:
            return f"{config} is empty: a config is a YAML mapping of options, like configs/quickstart.yaml"
        if not isinstance(options, dict):
            kind = "list" if isinstance(options, list) else type(options).__name__
            return f"{config} holds a YAML {kind}, not a mapping of options (option: value lines, like configs/quickstart.yaml)"
    return message


def callable_problem(texts: list[str]) -> str | None:
    """What is wrong with the value of an option typed as a Callable (a class or a function named by its import path,
    as ``environment`` and ``trl_environment`` of an EnvironmentTask) and what was expected, from the messages of
    jsonargparse's nested errors, outermost first; None where no such option failed."""
    context = next((text for text in reversed(texts) if "Given value: " in text), "")
    if "Callable[" not in context:
        return None
    given = re.findall(r"Given value: (.+)", context)[-1]
    if untyped := re.search(r"Expected '[^']+' to be a function that returns <class '(\w+)'>", context):
        kind = untyped[1]
        return (f"{given} is a function without the return type hint -> {kind}, which the option needs to take it: add it "
                f"(def {given.rpartition('.')[2]}() -> {kind}), or name a subclass of {kind}")
    problem = next((said.format(*found.groups()) for pattern, said in _CALLABLE_PROBLEMS
                    if (found := re.search(pattern, context))), None)
    if problem is None:
        return None
    signature = re.search(r"Callable\[\[(.*?)\], ([\w.]+)\]", context)
    if signature and signature[1]:
        expected = "a function"
    elif signature and signature[2] not in ("object", "typing.Any"):
        kind = signature[2].rpartition(".")[2]
        expected = f"a subclass of {kind} or a function with the return type hint -> {kind}"
    else:
        expected = "a class or a function"
    return f"{given} {problem}; expected the import path (module.Name) of {expected}"


def explain(error: BaseException) -> str:
    """One message from jsonargparse's nested errors: the option's dotted path, then the innermost message."""
    path, last_class, texts = [], None, []
    while True:
        texts.append(str(error))
        first_line = str(error).partition("\n")[0]
        key = re.match(r'Parser key "([^"]+)":', first_line)
        class_path = re.fullmatch(r"Problem with given class_path '(.+)':", first_line)
        if key and path[-1:] != [key[1]]:
            path += ["init_args", key[1]] if last_class else [key[1]]
            last_class = None
        if class_path:
            last_class = class_path[1]
        cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        wraps = key or class_path or first_line.startswith("Does not validate against any of the Union subtypes")
        if cause is None or not (wraps or str(cause).partition("\n")[0] == first_line):
            break
        error = cause
    innermost = error
    message = str(innermost) if isinstance(innermost, _MESSAGE_SAYS_ALL) else f"{type(innermost).__name__}: {innermost}"
    message = callable_problem(texts) or message
    if "Does not validate against any of the Union subtypes" in message and (
        given := re.search(r"Problem with given class_path '(.+)':\s*\n\s*(.+)", message)
    ):
        last_class, message = given[1], given[2]
    if unknown := re.fullmatch(r"Option '(.+)' is not accepted", message):
        option = ".".join(path + ["init_args", unknown[1]])
        listed = f" (lit-cancel fit --{path[0]}.help {last_class} lists them)" if len(path) == 1 else ""
        return f"{option}: {last_class} has no option {unknown[1]!r}{listed}"
    if path[-1:] == ["objective"] and last_class and re.search(r"has no attribute|No module named|not accessible", message):
        message += f"; the presets: {', '.join('lit_cancel.' + name for name in _PRESETS)}"
    if re.search(r"(--|')(optimizer|lr_scheduler)\b", message):
        message += "; the optimizer and its schedule are options of the module: model.init_args.optimizer and model.init_args.lr_scheduler"
    where = ".".join(path)
    if last_class:
        where = f"{where} ({last_class})" if where else last_class
    return f"{where}: {message}" if where else message

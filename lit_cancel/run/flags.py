"""Options spelled in every ``lit-cancel`` command as in any other: ``--at_step`` or ``--at-step`` whichever the command
defines, and an on/off option as ``fit`` takes one: ``--overwrite``, ``--overwrite true``, ``--overwrite=false``."""

import argparse

_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


def spelled_as_flags(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` with each of ``flags`` that is given a value (``--json true``, ``--json=false``) written as argparse's
    ``store_true`` reads it: the bare flag when true, nothing when false. Raises ArgumentTypeError for another value."""
    spelled, index = [], 0
    while index < len(argv):
        name, equals, value = argv[index].partition("=")
        if name not in flags:
            spelled.append(argv[index])
        else:
            if not equals and index + 1 < len(argv) and argv[index + 1].lower() in _WORDS:
                index, value, equals = index + 1, argv[index + 1], "="
            if equals and value.lower() not in _WORDS:
                raise argparse.ArgumentTypeError(f"{name}: expected true or false, got {value!r}")
            if not equals or _WORDS[value.lower()]:
                spelled.append(name)
        index += 1
    return spelled


def spelled_as_defined(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with each long option that ``parser`` defines with ``-`` where it has ``_`` (or the reverse) spelled as
    defined, and each of its on/off options given a value written as :func:`spelled_as_flags` does."""
    defined = parser._option_string_actions
    respelled = []
    for argument in argv:
        name, equals, value = argument.partition("=")
        if name.startswith("--") and name not in defined:
            other = "--" + (name[2:].replace("_", "-") if "_" in name else name[2:].replace("-", "_"))
            argument = other + equals + value if other in defined else argument
        respelled.append(argument)
    flags = {name for name, action in defined.items() if isinstance(action, argparse._StoreTrueAction) and name.startswith("--")}
    return spelled_as_flags(respelled, flags)

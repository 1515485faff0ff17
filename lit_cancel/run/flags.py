"""On/off options spelled in every ``lit-cancel`` command as ``fit`` spells them: ``--overwrite``, ``--overwrite true``,
``--overwrite=false``."""

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

"""The ``lit-cancel`` console script. It imports nothing heavy itself, so that a Ctrl-C while torch and Lightning load
ends in the documented line rather than a traceback of the import."""

import os
import signal
import sys

INTERRUPTED = 128 + signal.SIGINT


def main() -> None:
    """Loads the command line and runs it (see :func:`lit_cancel.run.commands.main`)."""
    try:
        from lit_cancel.run.commands import main as run_command
    except KeyboardInterrupt:
        if os.environ.get("LIT_CANCEL_DEBUG", "") not in ("", "0"):
            raise
        sys.stderr.write("lit-cancel: stopped by Ctrl-C (SIGINT) before the run started: nothing to resume\n")
        sys.exit(INTERRUPTED)
    run_command()


if __name__ == "__main__":
    main()

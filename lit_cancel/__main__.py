"""``python -m lit_cancel``: the ``lit-cancel`` command."""

from lit_cancel.run.console import main

main()

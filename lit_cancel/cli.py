"""The ``lit-cancel`` command: ``LightningCLI`` with the project's modules and links."""

import sys

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch import LightningDataModule, LightningModule

from lit_cancel import audit


class LitCancelCLI(LightningCLI):
    """``LightningCLI`` in subclass mode; the tokenizer path follows the model path.

    Before ``fit`` starts from scratch (no ``--ckpt_path``), it validates once, so the held-out
    accuracy of the starting policy is logged at step 0.
    """

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.model_path", "data.init_args.tokenizer_path")

    def before_fit(self) -> None:
        if self.config.fit.get("ckpt_path") is None:
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)


def run_cli(args: list[str] | None = None) -> LitCancelCLI:
    """Runs the command line and returns it; ``args`` replaces ``sys.argv[1:]`` (as in tests)."""
    return LitCancelCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        # validation metrics updated under inference mode by the validation before fit could not
        # be updated again by fit's validation, which runs under no_grad
        trainer_defaults={"inference_mode": False},
        args=args,
    )


def main() -> None:
    """The ``lit-cancel`` console script: LightningCLI's subcommands, and ``audit-objective``."""
    if sys.argv[1:2] == ["audit-objective"]:
        sys.exit(audit.main(sys.argv[2:]))
    run_cli()


if __name__ == "__main__":
    main()

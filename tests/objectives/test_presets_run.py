from pathlib import Path

import pytest
import torch

from lit_cancel import PRESETS, Objective
from lit_cancel.objectives import presets
from lit_cancel.run.cli import run_cli

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def test_every_objective_the_presets_module_defines_is_a_preset_in_the_order_defined():
    defined = [name for name, value in vars(presets).items()
               if isinstance(value, type) and issubclass(value, Objective) and value.__module__ == presets.__name__ and name[0] != "_"]
    assert list(PRESETS) == defined == ["GRPO", "DrGRPO", "DAPO", "GSPO", "DFPOMin", "DFPOOrth", "DFPOMinTR", "RLOO"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_quickstart_trains_with_each_preset(name, tmp_path):
    class_path = f"lit_cancel.{PRESETS[name].__name__}"
    cli = run_cli([
        "fit", "--config", str(QUICKSTART), f"--model.init_args.objective={class_path}",
        "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
        "--data.init_args.prompts_per_round=16", "--data.init_args.group_size=4",
        # two steps per round: the second is off-policy and uses the recorded old log-probs
        "--data.init_args.mini_batches_per_round=2",
        "--data.init_args.task.init_args.val_size=4", "--model.init_args.val_samples=1",
    ])
    assert type(cli.model.objective).__name__ == PRESETS[name].__name__
    assert cli.trainer.global_step == 2
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["loss/policy"]) and 0 < metrics["objective/ratio_mean"] < 2
    assert metrics["objective/approx_kl"] > 0  # the first step moved the policy: the second step's ratios are not 1

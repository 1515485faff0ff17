"""What a checkpoint holds of a run's rounds (``RolloutDataModule.state_dict``), and whether it can go on in this run.

The state names the options it depends on (its run shape: the round sizes, the plan and the objective) by their
command-line names, and a class by its public name where lit_cancel exports it, so that a checkpoint written before the
class moved (``lit_cancel.presets.GRPO``, ``lit_cancel.plans.QueryPreserved``) still compares equal.
"""

from lit_cancel.exports import EXPORTS

# the options of a run shape that name a class
CLASS_OPTIONS = ("data.init_args.plan", "model.init_args.objective")


def check_resume(saved_shape: dict, shape: dict, processes: list[dict], world: int, allow_changes: bool) -> None:
    """Raises ValueError when a checkpoint's rollout state cannot go on in this run: options of this run's ``shape`` that
    differ from the checkpoint's ``saved_shape`` (unless ``allow_changes``), or unspent rollouts in the states of
    ``processes`` (the checkpoint's, one a process) when this run has another number, ``world``."""
    saved_shape = {name: public_class_path(value) if name in CLASS_OPTIONS and value else value for name, value in saved_shape.items()}
    changed = [f"{name} {saved_shape[name]!r} -> {value!r}" for name, value in shape.items()
               if name in saved_shape and saved_shape[name] != value]
    if changed and not allow_changes:
        raise ValueError(
            f"the checkpoint was written by a run with other settings: {'; '.join(changed)} "
            f"(resume with the checkpoint's settings, or pass --data.init_args.allow_resume_changes true)"
        )
    saved_world = len(processes)
    if saved_world != world and any(p.get("pending") or p.get("waiting") is not None for p in processes):
        raise ValueError(
            f"the checkpoint holds the unspent rollouts of {saved_world} process{'es' * (saved_world > 1)} in the middle "
            f"of a round and this run has {world}: resume on {saved_world} (trainer.devices x trainer.num_nodes), or "
            "from a checkpoint written at the end of a round with no rollouts waiting"
        )


def class_path(value: object) -> str | None:
    """The class of ``value`` by its public name, ``lit_cancel.GRPO``, where lit_cancel exports it; else by its module."""
    return None if value is None else public_class_path(f"{type(value).__module__}.{type(value).__qualname__}")


def public_class_path(class_path: str) -> str:
    """``lit_cancel.NAME`` for the class path of a class that lit_cancel exports as ``NAME``, whichever of its modules
    the path names (checkpoints written before the sub-packages name ``lit_cancel.presets.GRPO``); else ``class_path``."""
    name = class_path.rpartition(".")[2]
    return f"lit_cancel.{name}" if class_path.startswith("lit_cancel.") and name in EXPORTS else class_path

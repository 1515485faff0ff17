"""DataModules: held-out prompts for validation, and rollout rounds cut into mini-batches for RL."""

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedTokenizerBase

from lit_cancel.batch import RolloutBatch
from lit_cancel.rounds.failures import FailureBudget
from lit_cancel.rounds.plans import MiniBatchPlan, QueryPreserved, groups_split, micro_batches
from lit_cancel.rounds.producer import Processes, RolloutProducer
from lit_cancel.rounds.resume import check_resume, class_path
from lit_cancel.rounds.sample import encode_prompts
from lit_cancel.rounds.staleness import Staleness
from lit_cancel.tasks import Record, Task

ENGINE_MAX_MODEL_LEN = "model.init_args.engine.init_args.max_model_len"


class TaskDataModule(L.LightningDataModule):
    """A task's held-out prompts, tokenised with the tokenizer of the LightningModule being trained.

    Args:
        task: where prompts come from and how completions are rewarded.
        val_batch_size: held-out prompts per validation batch.
    """

    def __init__(self, task: Task, val_batch_size: int = 200):
        super().__init__()
        if val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1, got {val_batch_size}")
        self.task, self.val_batch_size = task, val_batch_size

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the module this datamodule feeds (one tokenizer per run, the policy's)."""
        if self.trainer is None or self.trainer.lightning_module is None:
            raise RuntimeError(f"{type(self).__name__} uses the tokenizer of the LightningModule it feeds: attach both to a Trainer first")
        return self.trainer.lightning_module.tokenizer

    def val_batch(self, numbered: list[tuple[int, Record]]) -> dict:
        """A validation batch of ``(index, record)`` pairs: left-padded prompt ids and mask, the records, and their
        ``indices`` among the task's held-out records (for messages that name a record)."""
        indices, records = zip(*numbered, strict=True)
        return encode_prompts(self.tokenizer, list(records)) | {"indices": list(indices)}

    def drift_probes(self, count: int) -> list[dict]:
        """Up to ``count`` held-out prompts with their reference solutions, for ``SolutionProbabilityDriftMonitor``: the
        task's (:meth:`~lit_cancel.tasks.Task.drift_probes`)."""
        return self.task.drift_probes(count)

    def micro_batch_shape(self, max_new_tokens: int) -> tuple[int, int]:
        """``(rows, tokens)`` at most of a training micro-batch in each process, before training, for
        ``activation_checkpointing: auto``; only a :class:`RolloutDataModule` can tell."""
        raise ValueError(f"model.init_args.activation_checkpointing auto sizes the micro-batch from a RolloutDataModule's round, "
                         f"and {type(self).__name__} has none; set a mode instead")

    def longest_row(self, max_new_tokens: int) -> int:
        """Tokens of a prompt and its rollout at most: the longest of the first 1,000 training prompts and the tokens
        that may follow it (the task's :meth:`~lit_cancel.tasks.Task.new_tokens_limit` of ``max_new_tokens``)."""
        prompts = [record["prompt"] for record in self.task.train_records()[:1000]]
        longest_prompt = max((len(ids) for ids in self.tokenizer(prompts)["input_ids"]), default=0)
        return longest_prompt + self.task.new_tokens_limit(max_new_tokens)[0]

    def val_dataloader(self) -> DataLoader:
        return DataLoader(list(enumerate(self.task.val_records())), batch_size=self.val_batch_size, collate_fn=self.val_batch)


class _NextMiniBatch:
    """Placeholder yielded by the train dataloader; the datamodule replaces it with a real mini-batch."""


class _Placeholders(IterableDataset):
    def __iter__(self):
        while True:
            yield _NextMiniBatch()


def check_prompts_fit(task: Task, module: L.LightningModule, checked_room: int | None) -> int | None:
    """Raises ValueError naming the longest prompt of ``task`` when it leaves no room for ``module.max_new_tokens`` in the
    context of the module's model (``max_position_embeddings``), or in its engine's ``max_model_len`` where that is
    shorter (vLLM refuses a longer prompt and cuts a completion there). Returns the room every prompt fits in; where it
    is ``checked_room``, what an earlier call returned, the prompts are not read again. A module without a context
    limit or ``max_new_tokens`` is not checked."""
    config = getattr(getattr(getattr(module, "policy", None), "model", None), "config", None)
    limits = {
        "the model's context: max_position_embeddings": getattr(config, "max_position_embeddings", None),
        f"the engine's {ENGINE_MAX_MODEL_LEN}": getattr(getattr(module, "engine", None), "max_model_len", None),
    }
    limits = {name: value for name, value in limits.items() if isinstance(value, int)}
    max_new_tokens, name, option = task.new_tokens_limit(getattr(module, "max_new_tokens", None))
    if not limits or not isinstance(max_new_tokens, int):
        return checked_room
    limit = min(limits, key=limits.__getitem__)
    context = limits[limit]
    room = context - max_new_tokens
    if room == checked_room:
        return room  # checked already (the CLI checks before its first validation, fit's setup again)
    for split, records in (("train", task.train_records()), ("val", task.val_records())):
        lengths = [len(ids) for ids in module.tokenizer([r["prompt"] for r in records])["input_ids"]]
        longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        if longest is not None and lengths[longest] > room:
            raise_length = f", raise {ENGINE_MAX_MODEL_LEN}," if ENGINE_MAX_MODEL_LEN in limit else ","
            raise ValueError(
                f"the longest {split} prompt ({task.record_source(split, longest)}, {lengths[longest]} tokens) does not fit "
                f"{limit}={context} minus {name}={max_new_tokens} leaves {room}; "
                f"shorten or drop the long prompts{raise_length} or lower {option}"
            )
    return room


class RolloutDataModule(TaskDataModule):
    """Rollout rounds: prompts -> ``rollout()`` -> rewards -> group advantages -> planned mini-batches.

    Sizes, per round and summed over processes unless said otherwise:

    * ``prompts_per_round`` prompts, split evenly across processes; ``group_size`` (``G``)
      rollouts of each, so a round has ``prompts_per_round * group_size`` rollouts;
    * ``mini_batches_per_round`` optimizer steps per epoch over the round, ``epochs_per_round``
      (``mu``) epochs: ``mini_batches_per_round * epochs_per_round`` optimizer steps per round;
      after the first, steps are off-policy and use the log-probs recorded at rollout time;
    * each step is split into ``trainer.accumulate_grad_batches`` micro-batches (Lightning's own
      option), so a micro-batch has ``rollouts / processes / mini_batches / accumulate`` rollouts.

    Each round comes from the datamodule's :class:`~lit_cancel.rounds.producer.RolloutProducer` (``producer``):
    it draws the prompts, samples ``G`` completions of each with the LightningModule's engine, scores
    them with the task's reward and computes advantages with the module's ``objective.advantages``
    over each whole group. With ``dynamic_sampling`` (DAPO), groups whose
    rewards are all equal are dropped and more prompts drawn, at most ``max_prompt_draws`` draws;
    at the limit the round goes on with the dropped groups refilling its places (their advantages
    are zero, so they add no policy gradient) and logs how many were kept out. The ``plan`` then
    decides which rollouts meet in which step. Every process builds and keeps its own groups, so a
    group never spans processes; counts that normalise the loss are summed across processes.

    Lightning fetches one batch ahead of the training step, so the train dataloader yields
    placeholders and the round is sampled in ``on_before_batch_transfer``, which runs after the
    previous optimizer step: rollouts always come from the current policy. The round counters and
    every process's unspent micro-batches and rollouts waiting for a later round are in ``state_dict``,
    so a run resumed mid-round, on as many processes, continues without repeating or losing rollouts.

    Args:
        task: where prompts come from and how completions are rewarded.
        prompts_per_round: prompts per round, summed over processes.
        group_size: rollouts sampled per prompt (``G``), at least 2.
        mini_batches_per_round: optimizer steps per epoch over a round.
        epochs_per_round: passes over a round (``mu``); each pass is planned afresh.
        plan: the mini-batch plan; :class:`QueryPreserved` when None.
        dynamic_sampling: drop groups whose rewards are all equal and draw more prompts.
        max_prompt_draws: draws of ``prompts_per_round`` prompts per round at most, with dynamic sampling.
        val_batch_size: held-out prompts per validation batch.
        seed: seed of the prompt order, the sampling and the plans.
        allow_resume_changes: resume from a checkpoint whose round sizes, plan or objective differ
            from this run's; without it such a resume stops at start-up and names what changed.
        max_failed_share: the share of a round's episodes (an agent task's) whose environment may fail: a failed
            episode's row is inert and its group trains its other members (:mod:`lit_cancel.rounds.failures`); a round
            above it is a bad round. A validation outside ``fit`` (the one before training, ``lit-cancel validate``)
            above it is refused. 0: any failure makes a bad round.
        max_failed_rounds: bad rounds in a row that stop the run, naming the most frequent cause and a failing record.

    The failure budget is the datamodule's, not the task's, because its state (the bad rounds in a row) must be in the
    checkpoint with the round counters it goes with, and the datamodule's ``state_dict`` is what a checkpoint keeps of
    the rounds.
    """

    def __init__(
        self,
        task: Task,
        prompts_per_round: int = 16,
        group_size: int = 8,
        mini_batches_per_round: int = 1,
        epochs_per_round: int = 1,
        plan: MiniBatchPlan | None = None,
        dynamic_sampling: bool = False,
        max_prompt_draws: int = 4,
        val_batch_size: int = 200,
        seed: int = 0,
        allow_resume_changes: bool = False,
        max_failed_share: float = 0.25,
        max_failed_rounds: int = 3,
    ):
        super().__init__(task, val_batch_size)
        if group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (advantages compare the completions of one prompt), got {group_size}"
            )
        for name, value in [("prompts_per_round", prompts_per_round), ("mini_batches_per_round", mini_batches_per_round),
                            ("epochs_per_round", epochs_per_round), ("max_prompt_draws", max_prompt_draws)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.plan = plan if plan is not None else QueryPreserved()
        self.plan.check(prompts_per_round * group_size, group_size, mini_batches_per_round, 1)
        self.prompts_per_round, self.group_size = prompts_per_round, group_size
        self.mini_batches_per_round, self.epochs_per_round = mini_batches_per_round, epochs_per_round
        self.dynamic_sampling, self.max_prompt_draws, self.seed = dynamic_sampling, max_prompt_draws, seed
        self.allow_resume_changes = allow_resume_changes
        # steps after a round's first are off-policy: they need the log-probs recorded at rollout time
        off_policy = mini_batches_per_round > 1 or epochs_per_round > 1 or self.plan.carries_rollouts
        self.failure_budget = FailureBudget(max_failed_share, max_failed_rounds, option="data.init_args.")
        self.producer = RolloutProducer(task, prompts_per_round, group_size, self.steps_per_round, dynamic_sampling, max_prompt_draws, seed,
                                        with_old_logprobs=off_policy, budget=self.failure_budget)
        # the room for prompts (context minus max_new_tokens) that every prompt was found to fit in
        self.prompts_fit_in: int | None = None
        self.rounds_done = 0
        self.pending: list[RolloutBatch] = []
        self.waiting: RolloutBatch | None = None
        # micro-batches handed to the training step, with the optimizer step they belong to
        self.in_flight: list[tuple[int, RolloutBatch]] = []

    def setup(self, stage: str) -> None:
        world = self.trainer.world_size if self.trainer is not None else 1
        accumulation = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        self.check_sizes(world, accumulation, fitting=stage == "fit", objective=self._objective())
        if self.trainer is not None and (engine := getattr(self.trainer.lightning_module, "engine", None)) is not None:
            Staleness(engine, self.steps_per_round).check_task(self.task)
        if stage == "fit" and self.trainer is not None:
            self.check_prompt_lengths(self.trainer.lightning_module)

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self.producer.stop()

    def check_prompt_lengths(self, module: L.LightningModule) -> None:
        """Raises ValueError naming the longest prompt that leaves no room for the module's completions
        (:func:`check_prompts_fit`)."""
        self.prompts_fit_in = check_prompts_fit(self.task, module, self.prompts_fit_in)

    def _objective(self) -> object:
        return getattr(self.trainer.lightning_module, "objective", None) if self.trainer is not None else None

    def check_sizes(self, world: int, accumulation: int, fitting: bool, objective: object = None) -> None:
        """Raises ValueError when a round does not split over ``world`` processes and ``accumulation``
        micro-batches per step, when ``objective`` transforms whole groups that the plan splits, or,
        when ``fitting``, the task has fewer training prompts than a round."""
        if self.prompts_per_round % world:
            raise ValueError(f"prompts_per_round={self.prompts_per_round} must be divisible by the number of processes ({world})")
        self.plan.check(self.prompts_per_round // world * self.group_size, self.group_size, self.mini_batches_per_round, accumulation)
        if getattr(objective, "group_transform", None) is not None and self.plan.splits_groups(self.mini_batches_per_round, accumulation):
            raise ValueError(
                f"{type(objective).__name__} transforms the weights of each whole group, but the plan {type(self.plan).__name__} "
                f"(mini_batches_per_round={self.mini_batches_per_round}, trainer.accumulate_grad_batches={accumulation}) "
                f"puts a group's rollouts in different micro-batches, where the transform sees only part of the group and "
                f"shared tokens stop cancelling: use the plan lit_cancel.QueryPreserved"
            )
        if fitting and len(self.task.train_records()) < self.prompts_per_round:
            raise ValueError(
                f"the task has {len(self.task.train_records())} training prompts, fewer than prompts_per_round={self.prompts_per_round}"
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Placeholders(), batch_size=None)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if not isinstance(batch, _NextMiniBatch):
            return batch
        if not self.pending:
            self.pending = self.make_round()
            self.rounds_done += 1
        step = self.trainer.global_step
        self.in_flight = [(s, b) for s, b in self.in_flight if s == step]
        self.in_flight.append((step, self.pending.pop(0)))
        return self.in_flight[-1][1]

    @property
    def steps_per_round(self) -> int:
        return self.mini_batches_per_round * self.epochs_per_round

    def micro_batch_shape(self, max_new_tokens: int) -> tuple[int, int]:
        rows = (self.prompts_per_round // self.trainer.world_size * self.group_size // self.mini_batches_per_round
                // self.trainer.accumulate_grad_batches)
        return max(1, rows), self.longest_row(max_new_tokens)

    def make_round(self) -> list[RolloutBatch]:
        """Samples one round with the current policy and plans its micro-batches."""
        steps_per_epoch = self.mini_batches_per_round
        fresh, stats = self.producer.sample_round(self.trainer.lightning_module, Processes.of(self.trainer), self.rounds_done)
        pool = fresh if self.waiting is None else RolloutBatch.concat([self.waiting.to(fresh.input_ids.device), fresh])
        generator = torch.Generator().manual_seed(self.producer.seed_of(self.trainer.global_rank, self.rounds_done, -1))
        selection = self.plan.select(pool, len(fresh), self.rounds_done, generator)
        device = pool.input_ids.device
        train = pool.select(selection.train.to(device))
        self.waiting = pool.select(selection.carry.to(device)) if len(selection.carry) else None
        if self.plan.carries_rollouts:
            stats["batch/waiting_rollouts"] = float(len(selection.carry))
            stats["batch/dropped_rollouts"] = float(selection.dropped)
        steps = []
        for epoch in range(self.epochs_per_round):
            split = self.plan.split(train, steps_per_epoch, generator)
            if epoch == 0:
                stats["batch/groups_split"] = float(groups_split(train.group_ids, split))
            steps += split
        return self.micro_batches(train, steps, stats)

    def micro_batches(self, train: RolloutBatch, steps: list[Tensor], stats: dict[str, float]) -> list[RolloutBatch]:
        """Each step's ``trainer.accumulate_grad_batches`` micro-batches, with the step's global counts (:func:`micro_batches`)."""
        return micro_batches(train, steps, stats, self.trainer.accumulate_grad_batches, self.trainer.world_size,
                             Processes.of(self.trainer).sum)

    def run_shape(self, objective: object) -> dict[str, object]:
        """The options a checkpoint's rollout state depends on, by their command-line names."""
        return {
            "data.init_args.group_size": self.group_size,
            "data.init_args.prompts_per_round": self.prompts_per_round,
            "data.init_args.mini_batches_per_round": self.mini_batches_per_round,
            "data.init_args.epochs_per_round": self.epochs_per_round,
            "data.init_args.plan": class_path(self.plan),
            "model.init_args.objective": class_path(objective),
        }

    def check_resume(self, saved: dict, objective: object, world: int) -> None:
        """Raises ValueError when the rollout state ``saved`` (a ``state_dict``) cannot go on in this run: options that
        differ from the checkpoint's (unless ``allow_resume_changes``), unspent rollouts of other than ``world`` processes
        (:func:`~lit_cancel.rounds.resume.check_resume`)."""
        check_resume(saved.get("run_shape", {}), self.run_shape(objective), _per_process(saved), world, self.allow_resume_changes)

    def state_dict(self) -> dict:
        """The round counters and each process's unspent micro-batches and waiting rollouts, by rank: gathered, as
        Lightning writes process 0's state only, so under several processes every process must call it (as
        ``Trainer.save_checkpoint`` does)."""
        # micro-batches of an optimizer step that has not happened yet (a checkpoint written on an
        # exception or Ctrl-C in the middle of a step) are trained again after a resume
        unfinished = [b for step, b in self.in_flight if self.trainer is None or step == self.trainer.global_step]
        own = {"pending": [b.to_state() for b in unfinished + self.pending],
               "waiting": None if self.waiting is None else self.waiting.to_state()}
        return {
            "run_shape": self.run_shape(self._objective()),
            "rounds_done": self.rounds_done,
            "prompt_draws": self.producer.prompt_draws,
            "failed_rounds_in_a_row": self.failure_budget.bad_rounds,
            "processes": _gathered(own),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the counters and this process's rollouts (none at the end of a round: such a checkpoint resumes
        on any number of processes); :meth:`check_resume` first. Nothing is restored under a trainer that runs other than
        ``fit`` (``validate --ckpt_path`` loads every state of the checkpoint): it samples no rounds, whatever their sizes."""
        if self.trainer is not None and self.trainer.state.fn not in (None, TrainerFn.FITTING):
            return
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        self.check_resume(state_dict, self._objective(), world)
        processes = _per_process(state_dict)
        own = processes[rank] if len(processes) == world else {"pending": [], "waiting": None}
        self.rounds_done, self.producer.prompt_draws = state_dict["rounds_done"], state_dict["prompt_draws"]
        self.failure_budget.bad_rounds = state_dict.get("failed_rounds_in_a_row", 0)  # none before it was kept
        self.pending = [RolloutBatch.from_state(s) for s in own["pending"]]
        self.waiting = None if own["waiting"] is None else RolloutBatch.from_state(own["waiting"])


def _gathered(state: dict) -> list[dict]:
    """``state`` of every process, by rank; ``[state]`` in a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def _per_process(saved: dict) -> list[dict]:
    """The per-process states in ``saved``; the state itself where written before they were (it holds one process's)."""
    return saved.get("processes", [saved])


"""A round of RL rollouts, one module per stage, in the order a round runs them.

* :mod:`.producer`: :class:`~lit_cancel.rounds.producer.RolloutProducer` owns a round: it runs the stages below for each
  draw of prompts, draws again under dynamic sampling, and has draws sampled ahead of the trainer;
* :mod:`.draw`: which prompts each draw takes (seeded permutations, sliced per process);
* :mod:`.sample`: the policy's completions of a draw (:class:`~lit_cancel.rounds.sample.Generation`), sampled now or
  ahead of the trainer;
* :mod:`.staleness`: how far sampling may run ahead of training (:class:`~lit_cancel.rounds.staleness.Staleness`, the one
  reader of the engine's ``max_staleness``);
* :mod:`.score`: rewards and correctness by the task (:class:`~lit_cancel.rounds.score.RewardError` for a reward
  function that fails);
* :mod:`.advantages`: what the objective needs of a draw: each whole group's advantages, the old and reference
  log-probs, as the draw's :class:`~lit_cancel.batch.RolloutBatch`;
* :mod:`.statistics`: the round's ``rollout/...`` statistics, and the warnings of a round that cannot teach;
* :mod:`.plans`: which rollouts meet in which optimizer step (the datamodule cuts a round by its plan);
* :mod:`.resume`: what a checkpoint holds of the rounds, and whether it can go on in this run.
"""

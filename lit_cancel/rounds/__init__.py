"""A round of RL rollouts: :mod:`.producer` owns a round, :mod:`.sample` holds what the policy samples, :mod:`.score`
one draw top to bottom, :mod:`.statistics` the warnings of a round that cannot teach, :mod:`.plans` which rollouts meet
in which optimizer step."""

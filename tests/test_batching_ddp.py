"""Two processes over gloo: each builds its own groups (dynamic sampling on, so both draw in step), and the
loss normalisers count the whole step."""

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "workers" / "ddp_batching.py"


def test_groups_stay_on_their_process_and_step_counts_are_global(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "seen")], check=True, capture_output=True, timeout=300)
    ranks = [torch.load(tmp_path / f"seen-rank{rank}.pt") for rank in (0, 1)]
    groups = [{g for batch in seen for g in batch["group_ids"]} for seen in ranks]
    assert len(groups[0]) == len(groups[1]) == 4  # 8 prompts per round, 4 per process
    assert not groups[0] & groups[1]  # a group never spans processes
    # 2 steps x 2 micro-batches per process; the Shuffled plan splits groups across steps
    assert [len(seen) for seen in ranks] == [4, 4]
    for step in range(2):
        micro = [batch for seen in ranks for batch in seen[2 * step : 2 * step + 2]]
        step_tokens = sum(batch["tokens"] for batch in micro)
        for batch in micro:
            # divided by the 2 processes x 2 micro-batches that DDP and accumulation average over
            assert batch["step_tokens"] == step_tokens / 4
            # a step has 2 x 8 sequences over both processes
            assert batch["step_sequences"] == 16 / 4 and batch["rows"] == 4

"""A verifiers 0.4 taskset: add two numbers with an ``add`` tool; reward 1.0 when the last number of the reply is the
answer. Its rows are add_problems.jsonl's (``prompt``, ``answer``).

The module is both the taskset (verifiers loads it by its import name, ``add_taskset``) and the tool server's entry
point: verifiers starts ``python -m add_taskset`` for each rollout, so its folder must be on ``PYTHONPATH``.
"""

import json
import re
from pathlib import Path

import verifiers.v1 as vf

ROWS = Path(__file__).with_name("add_problems.jsonl")


class AddToolset(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is advertised as `add`, not `add_toolset_add`

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers and return their sum."""
        return a + b


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [AddToolset(vf.ToolsetConfig(runtime=vf.SubprocessConfig()))]

    @vf.reward
    async def correct_answer(self, task: AddData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0


class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self):
        for line in ROWS.read_text().splitlines():
            yield AddTask(AddData(**json.loads(line)), self.config.task)


__all__ = ["AddTaskset"]

if __name__ == "__main__":
    AddToolset.run()

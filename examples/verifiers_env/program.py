"""The verifiers environment of add_taskset.py, run unchanged as a lit_cancel agent program: each episode is the
environment's own rollout against the client's endpoint, and its reward what the taskset's ``@vf.reward`` methods give.

Only the agent's seat is pinned: a local subprocess instead of verifiers' default Prime sandbox, and the plain chat loop
(harness ``null``) instead of the harness the taskset ships or, without one, the ``bash`` agent, so the policy's requests
are the taskset's prompt and tools. Outside training it runs against any OpenAI-compatible server:
``await run(openai.AsyncOpenAI(base_url=...), record)``.
"""

import os

import verifiers.v1 as vf

CONFIG = vf.SingleAgentEnvConfig(
    taskset=vf.TasksetConfig(id="add_taskset"),
    agent=vf.AgentConfig(runtime=vf.SubprocessConfig(), harness={"id": "null"}),
)
KEY_VARIABLE = "LIT_CANCEL_ENDPOINT_KEY"  # verifiers reads the API key from the environment variable it is told


async def run(client, record: dict) -> float:
    os.environ[KEY_VARIABLE] = client.api_key
    model = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=KEY_VARIABLE))
    # an environment per episode (a millisecond): one serving several episodes keeps every episode's client, one per
    # session URL, until it stops serving
    env = vf.load_environment(CONFIG)
    task_type = type(env.taskset).task_type()
    task = task_type(task_type.data_type()(**record), env.taskset.config.task)  # the record's fields are the task's data
    async with env.serving():
        episode = await env.run_episode(task, model)
    if not episode.ok:
        errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
        messages = (f"{error.type}: {' '.join(error.message.split())}" for error in errors)  # uv's span several lines
        raise RuntimeError("the verifiers episode failed: " + "; ".join(messages))
    return episode.traces[0].reward

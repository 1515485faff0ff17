"""Agent programs: an agent written against an OpenAI-style chat client trains unchanged.

A program is a plain async function ``async def run(client, record) -> float | None``: ``client`` is an
``openai.AsyncOpenAI`` pointed at the run's endpoint (:class:`~lit_cancel.agents.endpoint.ChatEndpoint`), one session per
episode; ``record`` a row of the task's data; what it returns is the episode's reward (None: the task's reward scores the
transcript). It needs no lit_cancel import.

A round's programs run concurrently in one event loop. The rollout takes turns as an environment's episodes do
(:func:`~lit_cancel.agents.episodes.run_episodes`): it waits until every running program has sent its next request or
ended, then samples all the waiting requests in one engine call (``keep_engine``: the decode loop continues each row from
its kept cache, a vLLM server from its prefix cache), so a slow program delays the round's next call by its own time,
up to ``episode_timeout``. Each session's tokens are kept as sampled (:mod:`~lit_cancel.agents.sessions`). A program that
raises, returns something else than a number or None, or runs past ``episode_timeout`` fails its episode only, as a
failing environment does (:mod:`lit_cancel.rounds.failures`).
"""

import asyncio
import concurrent.futures
import importlib
import inspect
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_cancel.agents.endpoint import ChatEndpoint, ChatRequest, EndpointError
from lit_cancel.agents.environment import EnvironmentFailure, EpisodeClock, factory_name
from lit_cancel.agents.episodes import Episode, EpisodeLimits, TurnCalls, as_generation, episode_stats
from lit_cancel.agents.sessions import ProgramSession
from lit_cancel.agents.tools import CallFormat
from lit_cancel.agents.trl_environment import dataset_row
from lit_cancel.rounds.sample import Generation
from lit_cancel.rounds.score import RewardError, checked_reward
from lit_cancel.tasks import Record

Program = Callable[[Any, Record], Awaitable[float | None]]


class ProgramLoop:
    """An event loop in a daemon thread, where programs run with their clients."""

    def __init__(self) -> None:
        try:
            self.openai = importlib.import_module("openai")
        except ImportError:
            raise ValueError("agent programs get an openai.AsyncOpenAI client: install the openai package "
                             "(pip install -e \".[programs]\")") from None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="lit-cancel-agent-programs").start()
        # one connection pool for every program's client: a client of its own each would build an SSL context per
        # episode; unbounded, since every running program holds a connection until the round's engine call answers it
        self.http = asyncio.run_coroutine_threadsafe(self.pool(), self.loop).result()

    async def pool(self) -> Any:
        # the HTTP library the installed openai is built on (httpx2 in its recent releases, httpx before), as both may
        # be installed and the other's Limits and Timeout would pass into its client unchecked
        httpx = importlib.import_module(self.openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])
        return self.openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                                   timeout=httpx.Timeout(None))

    def start(self, program: Program, base_url: str, key: str, record: Record,
              done: Callable[[object, BaseException | None], None]) -> concurrent.futures.Future:
        """Runs ``program`` on ``record`` with a client of ``base_url``; ``done(result, error)`` when it ends."""

        async def run() -> object:
            # no time limit on a request: it waits for the round's engine call, and episode_timeout bounds the program
            client = self.openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=self.http, timeout=None)
            return await program(client, record)

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)

        def ended(future: concurrent.futures.Future) -> None:
            if future.cancelled():
                return done(None, None)
            error = future.exception()
            done(None if error else future.result(), error)

        future.add_done_callback(ended)
        return future


def checked_program(program: Program | str) -> Program:
    """``program``, imported where it is a path (``package.module.run``); ValueError where it is not an async function."""
    if isinstance(program, str):
        module, _, name = program.rpartition(".")
        try:
            program = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(f"ProgramTask: program={program!r} cannot be imported ({error}); give module.function, "
                             "with the module's folder on PYTHONPATH") from None
    if not inspect.iscoroutinefunction(program):
        raise ValueError(f"ProgramTask: program {factory_name(program)} must be an async function "
                         "`async def run(client, record) -> float | None`")
    return program


class ProgramRollout:
    """The sessions of one call of the task's rollout, and the waits between its engine calls."""

    def __init__(self, program: Program, endpoint: ChatEndpoint, loop: ProgramLoop, sessions: list[ProgramSession]) -> None:
        self.program, self.endpoint, self.loop, self.sessions = program, endpoint, loop, sessions
        self.name = factory_name(program)
        self.changed = sessions[0].changed if sessions else threading.Condition()
        self.futures: dict[str, concurrent.futures.Future] = {}

    def start(self, records: list[Record]) -> None:
        for session, record in zip(self.sessions, records, strict=True):
            self.endpoint.open(session.name, session.ask)
            session.handed_at = time.monotonic()
            self.futures[session.name] = self.loop.start(self.program, self.endpoint.base_url(session.name),
                                                         self.endpoint.key, record, session.finish)

    def wait(self, busy: Callable[[ProgramSession], bool]) -> None:
        """Until no running session is ``busy``; one whose program runs past ``episode_timeout`` fails and is stopped."""
        with self.changed:
            while True:
                now = time.monotonic()
                for session in self.sessions:
                    if busy(session) and session.episode.failure is None and session.time_left(now) <= 0:
                        self.stop(session, EnvironmentFailure(
                            f"the agent program {self.name} did not answer on {session.episode.where} within "
                            f"episode_timeout={session.limits.episode_timeout:g} s", "timeout"))
                waiting = [s for s in self.sessions if busy(s) and s.episode.failure is None]
                if not waiting:
                    return
                left = min(s.time_left(now) for s in waiting)
                self.changed.wait(None if left == float("inf") else left)

    def stop(self, session: ProgramSession, failure: EnvironmentFailure) -> None:
        session.fail(failure)
        self.futures[session.name].cancel()

    def close(self) -> None:
        for session in self.sessions:
            self.endpoint.close(session.name)
            if not session.finished:
                self.futures[session.name].cancel()
            if session.pending is not None:
                session.reply(EndpointError(503, "the round is over"))

    def rewards(self) -> list[float]:
        """Each program's reward: what it returned (NaN for None: the task scores the transcript); 0.0 where its
        episode failed, or fails here (the program raised, or returned something else than a number or None)."""
        rewards = []
        for session in self.sessions:
            episode = session.episode
            if episode.failure is None and session.error is not None:
                error = session.error
                episode.fail(EnvironmentFailure(f"the agent program {self.name} raised on {episode.where}: "
                                                f"{type(error).__name__}: {error}", "program_raised"))
            elif episode.failure is None and session.result is not None:
                try:
                    rewards.append(checked_reward(session.result, f"the agent program {self.name}", f"on {episode.where}"))
                    continue
                except RewardError as error:
                    episode.fail(EnvironmentFailure(str(error), "reward_wrong_type"))
            rewards.append(float("nan") if episode.failure is None else 0.0)
        return rewards

    def stats(self) -> dict[str, float]:
        count = max(len(self.sessions), 1)
        return {
            "rollout/program_requests": sum(s.requests for s in self.sessions) / count,
            "rollout/history_rewrites": sum(s.history_rewrites for s in self.sessions) / count,
            "rollout/untrained_policy_tokens": sum(s.untrained_tokens for s in self.sessions) / count,
            "rollout/malformed_tool_calls": sum(s.malformed_calls for s in self.sessions) / count,
            "rollout/unauthorized_requests": float(self.endpoint.taken_unauthorized()),
        }


def run_programs(policy, program: Program, endpoint: ChatEndpoint, loop: ProgramLoop, template: PreTrainedTokenizerBase,
                 calls: CallFormat, limits: EpisodeLimits, records: list[Record], input_ids: Tensor, attention_mask: Tensor,
                 num_samples: int = 1, greedy: bool = False, names: Sequence[str] | None = None) -> Generation:
    """``num_samples`` episodes of ``program`` on each of ``records``, each episode one session of ``endpoint``, rows
    ordered as :func:`~lit_cancel.agents.episodes.run_episodes` orders them (sample ``k`` of record ``i`` at
    ``i * num_samples + k``). A row's prompt is its program's first request as the chat template renders it (the
    record's prompt in ``input_ids`` where the program made none); the program gets each record as its task made it
    (:func:`~lit_cancel.agents.trl_environment.dataset_row`)."""
    tokenizer, device = policy.tokenizer, input_ids.device
    changed, sessions, repeated = threading.Condition(), [], []
    for index, (record, ids, mask) in enumerate(zip(records, input_ids.cpu(), attention_mask.cpu(), strict=True)):
        where = names[index] if names is not None else f"record {index}"
        for _ in range(num_samples):
            episode = Episode(ids[mask.bool()].tolist(), None, where, EpisodeClock(limits.episode_timeout))
            sessions.append(ProgramSession(secrets.token_hex(6), episode, template, tokenizer, calls, limits, changed,
                                           endpoint.model))
            repeated.append(dataset_row(record))
    rollout = ProgramRollout(program, endpoint, loop, sessions)
    turn_tokens = limits.max_turn_tokens or policy.sampling_options().max_new_tokens
    stops = set(policy.stop_token_ids)
    calls = TurnCalls(policy, device, greedy)
    try:
        rollout.start(repeated)
        for _ in range(limits.max_turns):
            rollout.wait(ProgramSession.waiting_for_program)
            asking = [s for s in sessions if s.pending is not None and not s.over]
            if not asking and not (dist.is_initialized() and dist.get_world_size() > 1):
                break
            asked = [min(turn_tokens, s.pending.max_tokens or turn_tokens) for s in asking]
            room = max((limits.max_episode_tokens - len(s.episode.tokens) for s in asking), default=1)
            generation = calls([s.episode.prompt + s.episode.tokens for s in asking], min(max(asked, default=turn_tokens), room))
            for row, (session, limit) in enumerate(zip(asking, asked, strict=True)):
                answer_row(session, generation, row, limit, stops, tokenizer)
        policy.release_engine()
        for session in sessions:  # a program asking past max_turns gets empty completions from here on
            if session.pending is not None:
                session.end("turn_limit")
                session.reply(session.closing_reply())
        rollout.wait(lambda session: not session.finished)
    finally:
        rollout.close()
    rewards = rollout.rewards()
    episodes = [session.episode for session in sessions]
    for episode in episodes:
        episode.ending = episode.ending or "done"
    return as_generation(episodes, tokenizer.pad_token_id, device, rewards, calls.sync_seconds,
                         calls.stats | episode_stats(episodes) | rollout.stats())


def answer_row(session: ProgramSession, generation: Generation, row: int, limit: int, stops: set[int], tokenizer) -> None:
    """Row ``row`` of ``generation`` as the session's turn, cut at the request's own ``max_tokens`` (``limit``) and at
    the first of its ``stop`` strings: the turn keeps its tokens up to the one that completes the stop string (sampled,
    so trained) and the program reads the text before it, as OpenAI's API answers."""
    sampled = generation.completion_mask[row].bool()
    tokens = generation.input_ids[row, generation.prompt_length:][sampled].tolist()
    logprobs = None if generation.sampler_logprobs is None else generation.sampler_logprobs[row][sampled].tolist()
    if generation.sampler_steps is not None:
        session.episode.turn_steps.append(int(generation.sampler_steps[row]))
    text = generation.texts[row]
    if len(tokens) > limit:
        tokens, text = tokens[:limit], tokenizer.decode(tokens[:limit], skip_special_tokens=True)
    at_stop_token = bool(tokens) and tokens[-1] in stops
    found = [(text.find(stop), stop) for stop in session.pending.stop if stop in text]
    if found:
        position, stop = min(found)
        tokens, text, at_stop_token = tokens[:first_prefix_with(tokens, text[:position] + stop, tokenizer)], text[:position], False
    session.answer(tokens, text, None if logprobs is None else logprobs[:len(tokens)], at_stop_token or bool(found), at_stop_token)


def first_prefix_with(tokens: list[int], text: str, tokenizer) -> int:
    """The fewest of ``tokens`` whose text contains ``text`` (their whole text does); a binary search, as containing it
    holds for every longer prefix once it holds for one."""
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if text in tokenizer.decode(tokens[:middle], skip_special_tokens=True):
            high = middle
        else:
            low = middle + 1
    return high


class FirstRequest:
    """Reads a program's first request as the chat template renders it, and stops the program there."""

    def __init__(self, template: PreTrainedTokenizerBase) -> None:
        self.template, self.text, self.asked = template, None, threading.Event()

    def ask(self, request: ChatRequest) -> dict:
        if not self.asked.is_set():
            self.text = self.template.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True,
                                                          tokenize=False)
            self.asked.set()
        raise EndpointError(503, "the program's first request was read (the record's prompt); the program stops here")


def first_requests(program: Program, endpoint: ChatEndpoint, loop: ProgramLoop, template: PreTrainedTokenizerBase,
                   records: list[Record], names: list[str], timeout: float, chunk: int = 64) -> list[str]:
    """Each record's prompt: its program's first request, rendered; ValueError naming the record where the program
    raises, ends or runs past ``timeout`` seconds before asking."""
    prompts = []
    for start in range(0, len(records), chunk):
        readers = [FirstRequest(template) for _ in records[start:start + chunk]]
        futures = []
        for index, (reader, record) in enumerate(zip(readers, records[start:start + chunk], strict=True)):
            name = f"first-{start + index}-{secrets.token_hex(4)}"
            endpoint.open(name, reader.ask)
            futures.append((name, loop.start(program, endpoint.base_url(name), endpoint.key, record, lambda *_: None)))
        deadline = time.monotonic() + timeout
        for reader, (name, future), where in zip(readers, futures, names[start:start + chunk], strict=True):
            # the program ends at the refusal of its first request (or it catches it: then its request was read)
            concurrent.futures.wait([future], timeout=max(deadline - time.monotonic(), 0.0))
            asked = reader.asked.is_set()
            future.cancel()
            endpoint.close(name)
            if asked:
                prompts.append(reader.text)
                continue
            name = factory_name(program)
            if not future.done():
                raise ValueError(f"the agent program {name} made no request on {where} within {timeout:g} s")
            error = None if future.cancelled() else future.exception()
            if error is not None:
                raise ValueError(f"the agent program {name} raised on {where} before its first request: "
                                 f"{type(error).__name__}: {error}")
            raise ValueError(f"the agent program {name} returned on {where} before its first request (a program's first "
                             "request is its episode's prompt)")
    return prompts

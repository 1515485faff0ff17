"""An agent program's episode as the endpoint sees it: chat requests in, the tokens it sampled kept as they were.

A program sends whole conversations; its episode is one token sequence (:mod:`~lit_cancel.agents.episodes`). Each
request's messages are rendered by the chat template. The first rendering is the episode's prompt. A later request
*extends* the episode when its rendering starts with the rendering of the previous request's messages followed by the
reply the endpoint gave: then only the text after that reply's stop token is tokenized and appended (the environment's
tokens: tool results, a new user message, the next assistant header), and every token the policy sampled stays as it
was sampled, whatever the template would have re-rendered for it (the spacing of a tool call's JSON, say).

**History rewrites.** A request that does not extend the episode (a template that drops earlier ``<think>`` blocks, a
program that summarises or edits its earlier messages, tools that changed) would put tokens in the context that were
never sampled there. The rule: the episode starts a new segment, with the new rendering as its prompt, and only the
segment an episode ends in is trained; the policy tokens of earlier segments are dropped from training and counted
(``rollout/history_rewrites``, ``rollout/untrained_policy_tokens``). The episode's reward is credited to the tokens of
its last segment. Within one user turn Qwen3's template keeps the think blocks, so a tool loop has no rewrite; each new
user message after a thinking turn starts a segment.
"""

import json
import threading
import time
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from lit_cancel.agents.endpoint import ChatRequest, EndpointError, completion_body
from lit_cancel.agents.environment import EnvironmentFailure
from lit_cancel.agents.episodes import Episode, EpisodeLimits
from lit_cancel.agents.tools import CallFormat, MalformedCall


@dataclass
class Segment:
    """What the last request left: its messages and tools, and the reply that answered it."""

    messages: list[dict]
    tools: list[dict] | None
    reply: dict | None = None
    stop_text: str = ""  # the reply's stop token as text, where the policy ended it with one


class ProgramSession:
    """One program's episode: :meth:`ask` (an endpoint thread, one request at a time) renders a request into the
    episode's tokens and waits; :meth:`answer` (the rollout's loop) appends the turn the engine sampled and replies.

    Args:
        name: the session's name in its URL and completion ids.
        episode: the episode the session fills.
        template: the tokenizer whose chat template renders requests.
        tokenizer: the policy's tokenizer, which tokenizes the renderings.
        calls: how tool calls are written in the policy's turns (they come back as OpenAI ``tool_calls``).
        limits: the task's episode limits.
        changed: notified whenever a session gets a request or its program ends.
        model: the model's name in completions.
    """

    def __init__(self, name: str, episode: Episode, template: PreTrainedTokenizerBase, tokenizer: PreTrainedTokenizerBase,
                 calls: CallFormat, limits: EpisodeLimits, changed: threading.Condition, model: str = "policy") -> None:
        self.name, self.episode, self.template, self.tokenizer = name, episode, template, tokenizer
        self.calls, self.limits, self.changed, self.model = calls, limits, changed, model
        self.segment: Segment | None = None
        self.pending: ChatRequest | None = None
        self.response: dict | EndpointError | None = None
        self.responded = threading.Event()
        self.over = False  # the episode ended for training: later requests are answered empty
        self.finished = False  # the program returned or raised
        self.result: object = None
        self.error: BaseException | None = None
        self.handed_at = time.monotonic()  # when the program last got control (started, or got a reply)
        self.requests = self.history_rewrites = self.untrained_tokens = self.malformed_calls = 0

    def ask(self, request: ChatRequest) -> dict:
        """The completion of ``request``: rendered into the episode, then sampled by the round's next engine call."""
        with self.changed:
            if self.pending is not None:
                raise EndpointError(409, "this session already waits for a completion: send one request at a time")
            self.requests += 1
            self.episode.clock.spent += time.monotonic() - self.handed_at
            if not (self.over or self.finished):
                self.extend(request)
            if self.over or self.finished:
                self.handed_at = time.monotonic()
                return self.closing_reply()
            self.pending, self.response = request, None
            self.responded.clear()
            self.changed.notify_all()
        self.responded.wait()
        if isinstance(self.response, EndpointError):
            raise self.response
        return self.response

    def extend(self, request: ChatRequest) -> None:
        """Renders ``request`` into the episode: a continuation where it extends it, else a new segment."""
        rendered = self.rendered(request.messages, request.tools, True)
        if self.segment is None:
            self.episode.prompt = self.encode(rendered)
        else:
            before = self.rendered(self.segment.messages + [self.segment.reply], self.segment.tools, False)
            if rendered.startswith(before):
                self.append_context(rendered[self.reply_end(before):])
            else:
                self.history_rewrites += 1
                self.untrained_tokens += sum(self.episode.from_policy)
                self.episode.prompt = self.encode(rendered)
                self.episode.tokens, self.episode.from_policy, self.episode.sampler_logprobs = [], [], []
                self.episode.transcript = []
        self.segment = Segment(request.messages, request.tools)

    def rendered(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        try:
            return self.template.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                     tokenize=False)
        except Exception as error:
            raise EndpointError(400, f"the chat template cannot render these messages: {type(error).__name__}: {error}") from None

    def reply_end(self, before: str) -> int:
        """Where the last reply ends in ``before``: after its stop token's text where the policy ended it with its stop
        token (what the template writes after it, a newline say, is the environment's), else at the end."""
        stop = self.segment.stop_text
        position = before.rfind(stop) if stop else -1
        return len(before) if position < 0 else position + len(stop)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def append_context(self, text: str) -> None:
        """The environment's ``text`` appended up to the episode's token limit; the episode ends where it fills it."""
        if self.episode.append_reply(text, self.limits.max_episode_tokens, self.tokenizer):
            self.end("episode_cut")

    def answer(self, tokens: list[int], text: str, logprobs: list[float] | None, stopped: bool, at_stop_token: bool) -> None:
        """The engine sampled ``tokens`` (``text``, its stop token removed) for the pending request: appended as the
        policy's turn, and the reply sent (its tool calls read with the task's call format). ``stopped``: the turn ended
        (at the model's stop token, ``at_stop_token``, or at a stop string of the request), not cut at a limit."""
        episode = self.episode
        room = self.limits.max_episode_tokens - len(episode.tokens)
        episode.turns += 1
        episode.append(tokens[:room], True, None if logprobs is None else logprobs[:room])
        episode.transcript.append(text)
        finish = "stop"
        if len(tokens) > room or not stopped:
            self.end("episode_cut" if len(tokens) > room else "turn_cut")
            finish = "length"
        try:
            found = self.calls.parse(text) if stopped else []
        except MalformedCall:
            self.malformed_calls += 1  # the program reads the turn as text: it decides what a broken call means
            found = []
        # the reply as the program will send it back, its calls' arguments read into objects as templates render them
        self.segment.reply = {"role": "assistant", "content": text}
        self.segment.stop_text = self.tokenizer.decode(tokens[-1:]) if at_stop_token else ""
        episode.tool_calls += len(found)
        if found:
            self.segment.reply = {"role": "assistant", "content": self.calls.prose(text) or None, "tool_calls": [
                {"id": f"call_{self.name}_{episode.turns}_{index}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}} for index, call in enumerate(found)]}
            finish = "tool_calls" if finish == "stop" else finish
        if episode.turns >= self.limits.max_turns:
            self.end("turn_limit")
        message = with_arguments_as_text(self.segment.reply)
        self.reply(completion_body(self.name, self.requests, self.model, message, finish, len(episode.prompt), len(tokens)))

    def reply(self, response: dict | EndpointError) -> None:
        with self.changed:
            self.pending, self.response = None, response
            self.handed_at = time.monotonic()
            self.responded.set()

    def closing_reply(self) -> dict:
        """What a request gets once the episode is over: an empty completion cut for length, nothing sampled."""
        return completion_body(self.name, self.requests, self.model, {"role": "assistant", "content": ""}, "length", 0, 0)

    def end(self, ending: str) -> None:
        self.over = True
        self.episode.ending = self.episode.ending or ending

    def finish(self, result: object, error: BaseException | None) -> None:
        """The program returned ``result`` or raised ``error``."""
        with self.changed:
            self.episode.clock.spent += time.monotonic() - self.handed_at
            self.finished, self.result, self.error = True, result, error
            self.changed.notify_all()

    def fail(self, failure: EnvironmentFailure) -> None:
        """The episode fails; a request still waiting is answered with the reason (the program is being stopped)."""
        self.episode.fail(failure)
        self.over = True
        if self.pending is not None:
            self.reply(EndpointError(503, f"the episode failed: {failure}"))

    def waiting_for_program(self) -> bool:
        """The program holds control: it has not sent its next request, nor ended, and its episode runs."""
        return not (self.finished or self.over or self.pending is not None)

    def time_left(self, now: float) -> float:
        limit = self.limits.episode_timeout
        return float("inf") if limit is None else limit - self.episode.clock.spent - (now - self.handed_at)


def with_arguments_as_text(message: dict) -> dict:
    """``message`` as OpenAI's API sends it: each tool call's ``arguments`` as JSON text."""
    if not message.get("tool_calls"):
        return message
    return {**message, "tool_calls": [{**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
                                      for call in message["tool_calls"]]}

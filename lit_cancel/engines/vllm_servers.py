"""Rollouts from separate vLLM servers, with the weights pushed to them, synchronously or ahead of the trainer.

:class:`VLLMServerEngine` sends each prompt's group as one request (:mod:`lit_cancel.engines.server_messages`)
to one of its servers (:mod:`lit_cancel.engines.server_process`), spreading groups over the servers; an agent's
next turn goes back to the server that sampled its last one (:mod:`lit_cancel.engines.prefix_routes`). After the
policy changed, the next rollout first pushes its weights to every server as a new version, labelled
with the run and the optimizer step (:mod:`lit_cancel.engines.weight_pushes`: the whole model, or a LoRA run's
adapter); every completion comes back with the label of the weights that sampled it, and one that is not a version of
this run, or older than allowed, is refused.

With ``max_staleness: 0`` (synchronous) a round is sampled by exactly the weights it trains, as with
the other engines. With ``max_staleness: k`` the rollout producer asks for up to ``k`` later draws of
prompts while the trainer trains (:meth:`prefetch`); a draw is sent only once the servers hold
weights at most ``k`` rounds older than the round that will train it (admission control), so no
rollout is trained more than ``k`` rounds after the weights that sampled it.
"""

import atexit
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future

import torch

from lit_cancel.engines.adapters import adapter_config, adapter_refusal, adapter_server_args, adapters_to_push
from lit_cancel.engines.base import PolicyWeights, RolloutEngine, Sampled, SampleRequest, SamplingOptions, in_background
from lit_cancel.engines.launched_server import LaunchedServer
from lit_cancel.engines.prefix_routes import PrefixRoutes
from lit_cancel.engines.server_messages import (
    RolloutRequest,
    RolloutResult,
    ServerSampling,
    StaleRolloutError,
    parse_result,
    version_label,
)
from lit_cancel.engines.server_process import ServerClient, ServerError
from lit_cancel.engines.vllm_common import (
    VLLM_OPTIONS,
    engine_dtype,
    prompt_seeds,
    sampled_completions,
    sampling_options,
)
from lit_cancel.engines.weight_pushes import AdapterPush, FullPush

_ENGINE_KEY = "model.init_args.engine.init_args"


def check_reachable(urls: list[str], adapters: bool = False) -> None:
    """Refuses, in one line naming the option, a server that cannot be reached or lacks the routes the trainer needs (with
    ``adapters``, those that load LoRA adapters)."""
    for url in urls:
        try:
            ServerClient(url).check(adapters)
        except ServerError as error:
            raise ValueError(f"{_ENGINE_KEY}.urls: {error}") from None


def group_requests(request: SampleRequest, oldest_step: int, first_seed: int | None = None) -> tuple[RolloutRequest, ...]:
    """One server request per prompt of ``request``, each seeded as :class:`~lit_cancel.VLLMEngine` seeds its prompts
    (so both engines draw the same random numbers; from ``first_seed`` where given), from weights of step
    ``oldest_step`` or later."""
    options = request.options
    sampling = ServerSampling(
        options.temperature, options.top_p, options.max_new_tokens, options.stop_token_ids, request.greedy,
        tuple(sorted(sampling_options(options.generation_kwargs).items())),
    )
    seeds = prompt_seeds(len(request.input_ids), request.num_samples, first_seed)
    return tuple(
        RolloutRequest(tuple(ids[mask.bool()].tolist()), request.num_samples, sampling, None if request.greedy else seed, oldest_step)
        for ids, mask, seed in zip(request.input_ids.cpu(), request.attention_mask.cpu(), seeds, strict=True)
    )


class VLLMServerEngine(RolloutEngine):
    """Samples rollouts and validation completions on vLLM servers, pushing the policy's weights to them.

    Each prompt's ``group_size`` samples are one request, so a group always comes from one weights
    version. Weights reach the servers as safetensors files in ``weights_dir``, which every server
    must be able to read; with LoRA (``push_adapters``) the base weights once per server and then each version's
    adapter, loaded while the servers sample, the newest ``max_staleness + 1`` kept loaded. Before sampling, a server
    that does not hold the current version (one that restarted, or whose transfer stopped half-way) gets it first. A
    request whose server stops answering (its connection refused, no answer for ``server_timeout`` seconds, or another
    server answering at its URL: :class:`~lit_cancel.engines.server_process.ServerClient`) is given up and sent to the next
    server; when none answered for ``server_timeout`` seconds the run stops with an error naming the servers
    (the run's checkpoint callback saves ``last.ckpt``). A launched server is stopped with all its processes
    when the engine closes, at the latest (by its watchdog) when the trainer's process ends, even by kill -9.

    Logged each round: ``rollout/staleness`` and ``rollout/staleness_max`` (rounds between the weights
    that sampled a group and the round that trains it), ``rollout/queue_depth`` (draws sampled ahead,
    asynchronous mode), ``perf/trainer_wait_s`` (the trainer waiting for rollouts) and
    ``perf/server_wait_s`` (a draw waiting for the weights it may be sampled with).

    Args:
        urls: the servers' base URLs, e.g. ``["http://10.0.0.5:8000"]``; started with ``lit-cancel serve``.
        launch: start one server for the policy on 127.0.0.1 when the engine is first used, and stop it when
            the trainer's process ends; with ``urls`` empty.
        max_staleness: rounds the servers may sample ahead of the trainer; 0 is synchronous.
        weights_dir: a folder the servers read the weights from; None: a temporary folder (servers on this machine).
        server_cpus: CPU cores of the launched server (its process and threads); None: vLLM's own choice.
        trainer_cpus: CPU cores the trainer's process keeps to when it launches a server, e.g. ``[0]`` beside
            ``server_cpus: [1]``; None: unchanged.
        request_timeout: seconds one request may take on a server that answers.
        server_timeout: seconds a server may give no answer before its requests are given up, and seconds to wait
            for some server to answer before the run stops.
        startup_timeout: seconds a launched server may take to start.
        dtype: the launched server's dtype; None as :func:`~lit_cancel.engines.vllm_common.engine_dtype` chooses.
        max_model_len: the launched server's longest prompt plus completion; None: the model's.
        kv_cache_memory_bytes: the launched server's KV cache; None: 1 GiB without a GPU.
        server_args: further command-line arguments of the launched server (``vllm serve``'s).
        push_adapters: with LoRA, push each version's adapter alone; False: merge them and push the whole model.

    Example::

        RLModule(engine=VLLMServerEngine(urls=["http://10.0.0.5:8000"], weights_dir="/shared/weights", max_staleness=1))
    """

    supported_options = frozenset(VLLM_OPTIONS)
    holds_weights = True

    def __init__(
        self,
        urls: list[str] | None = None,
        launch: bool = False,
        max_staleness: int = 0,
        weights_dir: str | None = None,
        server_cpus: list[int] | None = None,
        trainer_cpus: list[int] | None = None,
        request_timeout: float = 600.0,
        server_timeout: float = 120.0,
        startup_timeout: float = 300.0,
        dtype: str | None = None,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        server_args: list[str] | None = None,
        push_adapters: bool = True,
    ):
        self.urls = [url.rstrip("/") for url in urls or []]
        if launch == bool(self.urls):
            raise ValueError(f"{_ENGINE_KEY}: give the servers' urls, or launch: true to start one here (not both)")
        if max_staleness < 0:
            raise ValueError(f"{_ENGINE_KEY}.max_staleness must be >= 0 (0 is synchronous), got {max_staleness}")
        timeouts = {"request_timeout": request_timeout, "server_timeout": server_timeout, "startup_timeout": startup_timeout}
        for name, seconds in timeouts.items():
            if seconds <= 0:
                raise ValueError(f"{_ENGINE_KEY}.{name} must be > 0 seconds, got {seconds}")
        if not launch and (server_cpus or trainer_cpus or server_args):
            raise ValueError(f"{_ENGINE_KEY}: server_cpus, trainer_cpus and server_args are for a launched server (launch: true)")
        self.launch, self.max_staleness, self.weights_dir = launch, max_staleness, weights_dir
        self.request_timeout, self.server_timeout, self.dtype, self.push_adapters = request_timeout, server_timeout, dtype, push_adapters
        self.server = LaunchedServer(
            server_cpus, trainer_cpus, startup_timeout, max_model_len, kv_cache_memory_bytes, list(server_args or [])
        ) if launch else None
        self.clients: list[ServerClient] = []
        self.run = ""
        # how versions reach the servers; the optimizer step of the current one; every label this run pushed, with its step
        self.pushes: FullPush | AdapterPush | None = None
        self.step: int | None = None
        self.pushed: dict[str, int] = {}
        self.version_changed = threading.Condition()
        self.closed = False
        # draws sampled ahead, by their requests' prompts and seeds: the future result, and the oldest step allowed
        self.ahead: dict[tuple, tuple[Future, int]] = {}
        self.routes = PrefixRoutes()  # an agent's next turn goes back to the server that holds its prefix
        self._temporary: list[str] = []

    def check(self, policy: PolicyWeights, options: SamplingOptions | None) -> None:
        """Refuses, in one line, servers that cannot be reached or lack the routes the trainer needs, and a server to launch
        on a machine without a GPU whose KV cache cannot hold one sequence of ``max_model_len`` tokens
        (:func:`~lit_cancel.engines.vllm_common.kv_cache_need`); with adapters to push, servers that cannot load them."""
        adapters = self.push_adapters and adapter_config(policy.model) is not None and adapter_refusal(policy.model) is None
        check_reachable(self.urls, adapters)
        if self.server is not None:
            self.server.check(policy, self._dtype(policy), options and options.max_new_tokens)

    def start(self, policy: PolicyWeights) -> None:
        """Connects to the servers (launching one first with ``launch``); the run's id labels its weights versions."""
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if self.launch and distributed:
            raise ValueError(f"{_ENGINE_KEY}.launch starts one server for one trainer process; with several, start servers "
                             "with lit-cancel serve and give their urls")
        if self.weights_dir is None and (not distributed or torch.distributed.get_rank() == 0):
            self.weights_dir = tempfile.mkdtemp(prefix="lit-cancel-weights-")
            self._temporary.append(self.weights_dir)
        # every process names the folders rank 0 writes: any of them may push the current ones to a server (ready)
        shared = [uuid.uuid4().hex[:8], self.weights_dir]
        if distributed:
            torch.distributed.broadcast_object_list(shared, src=0)
        self.run, self.weights_dir = shared
        os.makedirs(self.weights_dir, exist_ok=True)
        lora = adapters_to_push(policy.model, self.push_adapters, f"{_ENGINE_KEY}.push_adapters")
        keep = self.max_staleness + 1
        self.pushes = FullPush(self.weights_dir) if lora is None else AdapterPush(self.weights_dir, self.run, keep)
        atexit.register(self.close)  # the launched server and the temporary folders go with the process, however it ends
        if self.server is not None:
            try:
                self.urls = [self.server.start(policy, self._dtype(policy), lora and adapter_server_args(lora, keep))]
            except BaseException:  # a server that failed to start, or a Ctrl-C while it started: none is left running
                self.close()
                raise
        self.clients = [ServerClient(url, self.request_timeout, self.server_timeout, self._is_own) for url in self.urls]
        self.closed = False
        for client in self.clients:
            client.check(adapters=isinstance(self.pushes, AdapterPush))

    def _is_own(self, label: str) -> bool:
        """Whether a server's weights label is a version of this run's."""
        return label.startswith(f"{self.run}/")

    def close(self) -> None:
        """Stops the draws in flight and the launched server (every process of it, also when its own process died);
        the engine starts again when next used."""
        with self.version_changed:
            self.closed = True
            self.step, self.pushed, self.ahead = None, {}, {}
            self.version_changed.notify_all()
        for client in self.clients:  # a server does not stop while it still answers requests
            client.give_up("the engine was closed")
        if self.pushes is not None:
            self.pushes.close(self.clients)
        if self.server is not None:
            self.server.stop()
            self.urls = []
        if self.weights_dir in self._temporary:
            self.weights_dir = None
        for folder in self._temporary:
            shutil.rmtree(folder, ignore_errors=True)
        self._temporary, self.clients = [], []

    def sync(self, policy: PolicyWeights) -> float:
        started = time.perf_counter()
        if not self.clients:
            self.start(policy)
        # draws the servers may sample with the weights they hold finish on them first (the trainer waits for them here,
        # as the servers would, paused, until they finish): so every group of a draw comes from one weights version
        for future, oldest_step in list(self.ahead.values()):
            if self.pushes.pauses and self.step is not None and oldest_step <= self.step:
                future.exception()
        label = version_label(self.run, len(self.pushed))
        self.pushed[label] = policy.step
        self.pushes.push(policy, getattr(torch, self._dtype(policy)), label, self.clients)
        with self.version_changed:
            self.step = policy.step
            self.version_changed.notify_all()
        return time.perf_counter() - started

    def _dtype(self, policy: PolicyWeights) -> str:
        return engine_dtype(self.dtype, next(policy.model.parameters()).dtype, policy.device)

    def _generate(self, request: RolloutRequest) -> RolloutResult:
        """One request's result from the first server that answers it with acceptable weights. The request is sent again
        (to the next server, which first gets the current weights if it lacks them) until no server answered for
        ``server_timeout`` seconds, or its tries failed for that long."""
        started, first_failure, index = time.monotonic(), None, None
        errors: dict[str, str] = {}
        while True:
            with self.version_changed:
                if self.closed:
                    raise ServerError("the engine was closed")
                index = self.routes.choose(request.prompt_ids if index is None else None, len(self.clients))
            client = self.clients[index]
            try:
                sent = self.pushes.ready(client, request)  # the client first gets the current version where it lacks it
                result = parse_result(client.generate(sent), sent, self.pushed, client.url)
                self.routes.remember(request.prompt_ids, result.completion_ids, index)
                return result
            except (StaleRolloutError, ServerError) as error:  # a stale server is pushed the weights before the next try
                errors[client.url] = str(error)
            now = time.monotonic()
            first_failure = first_failure or now
            last_answer = max(started, *(client.answered for client in self.clients))
            if now - last_answer > self.server_timeout or now - first_failure > self.server_timeout:
                raise ServerError(
                    f"no vLLM server answered for {self.server_timeout:g} s ({_ENGINE_KEY}.server_timeout): "
                    + "; ".join(errors.values())
                )
            time.sleep(random.uniform(0.5, 1.5))

    def _draw(self, requests: tuple[RolloutRequest, ...]) -> tuple[list[RolloutResult], float]:
        """The results of a draw's requests, sent once the servers hold weights of ``oldest_step`` or later; and the
        seconds the draw waited for them."""
        waited = time.perf_counter()
        with self.version_changed:
            self.version_changed.wait_for(lambda: self.closed or (self.step is not None and self.step >= requests[0].oldest_step))
        waited = time.perf_counter() - waited
        futures = [in_background(self._generate, request) for request in requests]
        return [future.result() for future in futures], waited

    def prefetch(self, policy: PolicyWeights, request: SampleRequest, seed: int, oldest_step: int) -> None:
        if not self.clients:
            self.start(policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            requests = group_requests(request, oldest_step)
        key = tuple((r.prompt_ids, r.seed) for r in requests)
        if key not in self.ahead:
            self.ahead[key] = (in_background(self._draw, requests), oldest_step)

    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        if self.step is None:  # closed since the last push
            self.sync(policy)
        requests = group_requests(request, oldest_step=self.step)
        key = tuple((r.prompt_ids, r.seed) for r in requests)
        queued = sum(1 for k, (future, _) in self.ahead.items() if k != key)
        started = time.perf_counter()
        if not request.greedy and key in self.ahead:
            future, _ = self.ahead.pop(key)
            results, server_wait = future.result()
        else:
            results, server_wait = self._draw(requests)
        stats = {"perf/trainer_wait_s": time.perf_counter() - started, "perf/server_wait_s": server_wait,
                 "perf/prefix_routed_tokens": float(self.routes.taken_routed_tokens()), **self.pushes.pushed_bytes.report()}
        if self.max_staleness:
            stats["rollout/queue_depth"] = float(queued)
        return completions_of(request, results, stats)

    can_sample_ahead = True

    def sample_ahead(self, request: SampleRequest, oldest_step: int, first_seed: int) -> Sampled:
        results, server_wait = self._draw(group_requests(request, oldest_step, first_seed))
        return completions_of(request, results, {"perf/server_wait_s": server_wait})


def completions_of(request: SampleRequest, results: list[RolloutResult], stats: dict[str, float]) -> Sampled:
    """The servers' ``results`` of ``request``'s prompts as one :class:`Sampled`, with ``stats``."""
    num_samples = request.num_samples
    completions = [ids for result in results for ids in result.completion_ids]
    logprobs = None if request.greedy else [values for result in results for values in result.logprobs]
    steps = torch.tensor([result.step for result in results]).repeat_interleave(num_samples)
    return sampled_completions(
        request.input_ids, num_samples, completions, logprobs, request.options.pad_token_id, steps=steps, stats=stats
    )

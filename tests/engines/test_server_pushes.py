"""How the server engine pushes weights to its servers, against stand-in servers that answer vLLM's weight and generate
routes (no vLLM): every server loads at once, and no process puts older weights back over a newer version. The tests with
vLLM servers are in tests/engines/test_vllm_server.py."""

import json
import os
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist
from conftest import lora_sizes

from lit_cancel import LoRA, VLLMServerEngine
from lit_cancel.engines.base import PolicyWeights, in_background
from lit_cancel.engines.prefix_routes import PrefixRoutes
from lit_cancel.engines.server_messages import RolloutRequest, ServerSampling, version_label
from lit_cancel.engines.server_process import ServerClient, free_port
from lit_cancel.engines.weight_pushes import FullPush, push_weights
from lit_cancel.hub import load_causal_lm
from lit_cancel.sharding import ModelRoot

RUN = "run"
REQUEST = RolloutRequest((5, 6), 2, ServerSampling(1.0, 1.0, 1, (1,)), seed=0, oldest_step=1)
WEIGHTS = [("weight", torch.zeros(2))]


class StandInError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class StandInServer:
    """A vLLM server's weights label, its weights (the folder it last began to reload) and its pause, behind vLLM's routes.
    A reload replaces the weights as it begins, as vLLM's overwrites them tensor by tensor, and ends once ``reloaded``
    lets it; a generation waits while the server is paused, then answers with the label held."""

    def __init__(self):
        self.label, self.weights, self.paused = "default", None, False
        self.reloads: list[str] = []
        self.pauses = 0
        self.adapters: dict[str, str] = {}  # the LoRA adapters loaded: name, folder
        self.adapter_loads: list[str] = []
        self.sampled_with: list[str | None] = []  # each generation's adapter
        self.loads_adapters = True  # vLLM's routes that load adapters at run time are on
        self.generations = 0
        self.prompts: list[tuple[int, ...]] = []
        self.reloaded = lambda folder: None
        self.changed = threading.Condition()

    def answer(self, path: str, body: dict) -> dict:
        with self.changed:
            if path == "/weight_info":
                return {"weight_version": self.label}
            if path == "/v1/models":
                return {"data": [{"id": "base", "parent": None}, *({"id": name, "parent": "base"} for name in self.adapters)]}
            if "lora_adapter" in path and not self.loads_adapters:
                raise StandInError(404, "Not Found")
            if path == "/v1/unload_lora_adapter" and body["lora_name"] not in self.adapters:
                raise StandInError(400 if not body["lora_name"] else 404, "The lora adapter cannot be found.")
            if path == "/v1/load_lora_adapter":
                if body["lora_name"] in self.adapters:
                    raise StandInError(400, f"The lora adapter '{body['lora_name']}' has already been loaded.")
                self.adapters[body["lora_name"]] = body["lora_path"]
                self.adapter_loads.append(body["lora_name"])
            elif path == "/v1/unload_lora_adapter":
                del self.adapters[body["lora_name"]]
            elif path == "/inference/v1/generate" and body.get("model", "base") not in ("base", *self.adapters):
                raise StandInError(404, f"The model `{body['model']}` does not exist.")
            if path == "/pause":
                self.pauses += 1
                self.paused = True
            elif path == "/resume":
                self.paused = False
            elif path == "/update_weight_version":
                self.label = body["new_version"]
            elif path == "/collective_rpc":
                self.weights = body["kwargs"]["weights_path"]
                self.reloads.append(body["kwargs"]["weights_path"])
            elif path == "/inference/v1/generate":
                self.sampled_with.append(body.get("model"))
                self.generations += 1
                self.prompts.append(tuple(body["token_ids"]))
            self.changed.notify_all()
        if path == "/collective_rpc":
            self.reloaded(body["kwargs"]["weights_path"])
        if path == "/inference/v1/generate":
            with self.changed:
                self.changed.wait_for(lambda: not self.paused)
                span = [{"version": self.label, "start": 0, "end": 1}]
            choice = {"token_ids": [1], "weight_versions": span, "logprobs": {"content": [{"logprob": -1.0}]}}
            return {"choices": [{"index": index, **choice} for index in range(body["sampling_params"]["n"])]}
        return {}

    def restart(self) -> None:
        """What a server started again holds: its start-up weights, no adapters."""
        self.label, self.adapters = "default", {}

    def wait_for(self, condition) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: condition(self), timeout=10)


@contextmanager
def stand_in_servers(count: int):
    """``count`` stand-in servers; yields each one's state and URL."""
    servers, https = [], []
    for _ in range(count):
        state = StandInServer()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self, state=state):
                self.respond(state.answer(self.path.split("?")[0], {}))

            def do_POST(self, state=state):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                try:
                    self.respond(state.answer(self.path.split("?")[0], body))
                except threading.BrokenBarrierError:
                    self.send_error(500)
                except StandInError as error:
                    self.send_error(error.status, str(error))

            def respond(self, answer: dict) -> None:
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        http.daemon_threads = True
        threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
        servers.append((state, f"http://127.0.0.1:{http.server_address[1]}"))
        https.append(http)
    try:
        yield servers
    finally:
        for http in https:
            http.shutdown()
            http.server_close()


def engine_at(url: str, push: int, folder: str) -> VLLMServerEngine:
    """A trainer process's engine of the run ``RUN`` as its sync leaves it after push ``push`` (of step ``push``) from ``folder``."""
    engine = VLLMServerEngine(urls=[url], server_timeout=30)
    engine.run = RUN
    engine.clients = [ServerClient(url, 30, 30, engine._is_own)]
    engine.pushes = FullPush(str(folder))
    learn_push(engine, push, folder)
    return engine


def learn_push(engine: VLLMServerEngine, push: int, folder: str) -> None:
    with engine.version_changed:
        engine.pushed |= {version_label(RUN, done): done for done in range(push + 1)}
        engine.step, engine.pushes.current = push, (version_label(RUN, push), folder)


def test_a_process_one_version_behind_leaves_a_newer_push_alone_while_it_loads_and_after(tmp_path):
    old, new = str(tmp_path / "run-1"), str(tmp_path / "run-2")
    with stand_in_servers(1) as [(server, url)]:
        server.label, server.weights = "run/1", old
        loading = threading.Event()
        server.reloaded = lambda folder: loading.wait(10) if folder == new else None
        rank0, rank1 = engine_at(url, 1, old), engine_at(url, 1, old)

        push = in_background(push_weights, WEIGHTS, new, "run/2", rank0.clients)
        server.wait_for(lambda s: s.label == "run/2:loading")
        draw = in_background(rank1._generate, REQUEST)  # a request of rank 1's, sent again during rank 0's push
        server.wait_for(lambda s: s.generations == 1)  # held while the server is paused
        assert server.reloads == [new]

        loading.set()
        push.result(timeout=10)
        server.wait_for(lambda s: s.generations == 3)  # answered by run/2, which rank 1 does not know yet, then sent again
        assert (server.reloads, server.weights, server.label) == ([new], new, "run/2")
        assert not draw.done()

        learn_push(rank1, 2, new)  # rank 1 is through its own push_weights of run/2
        assert draw.result(timeout=10).step == 2
        assert server.reloads == [new]


@pytest.mark.parametrize(("label", "pushes"), [
    ("default", True),  # a restarted server
    ("other/7", True),  # another run's
    ("run/1", True),  # a server that was down during the last push
    ("run/1:loading", True),
    ("run/2:loading", True),  # the current version's transfer stopped half-way
    ("run/2", False),
    ("run/3", False),  # process 0's next push, which this process has yet to take part in
    ("run/3:loading", False),
])
def test_a_process_gives_a_server_its_current_weights_only_over_older_ones(tmp_path, label, pushes):
    current = str(tmp_path / "run-2")
    with stand_in_servers(1) as [(server, url)]:
        server.label = label
        engine = engine_at(url, 2, current)
        engine.pushes.ready(engine.clients[0], REQUEST)
        assert server.reloads == ([current] if pushes else [])
        assert server.label == ("run/2" if pushes else label)


def test_every_server_loads_a_push_at_once_and_one_that_is_down_is_skipped(tmp_path):
    folder = str(tmp_path / "run-0")
    with stand_in_servers(2) as servers:
        both_loading = threading.Barrier(2, timeout=5)  # a reload waits for the other server's to begin
        for server, _ in servers:
            server.reloaded = lambda _: both_loading.wait()
        down = f"http://127.0.0.1:{free_port()}"
        push_weights(WEIGHTS, folder, "run/0", [ServerClient(url) for url in (servers[0][1], down, servers[1][1])])
        assert [(server.label, server.reloads) for server, _ in servers] == [("run/0", [folder])] * 2


def test_the_servers_load_a_push_between_the_processes_barriers(tmp_path, monkeypatch):
    with stand_in_servers(1) as [(server, url)]:
        events = []
        server.reloaded = lambda _: events.append("reload")
        barrier = dist.barrier
        monkeypatch.setattr(dist, "barrier", lambda: events.append("barrier") or barrier())
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            push_weights(WEIGHTS, str(tmp_path / "run-0"), "run/0", [ServerClient(url)])
        finally:
            dist.destroy_process_group()
    # every process finished its draws with the weights the servers held (sync) before any server replaces them
    assert events == ["barrier", "reload", "barrier"]


def test_an_agents_next_turn_goes_back_to_the_server_that_sampled_its_last_and_new_prompts_are_spread(tmp_path):
    with stand_in_servers(2) as servers:
        urls = [url for _, url in servers]
        engine = VLLMServerEngine(urls=urls, server_timeout=30)
        engine.run = RUN
        engine.clients = [ServerClient(url, 30, 30, engine._is_own) for url in urls]
        engine.pushes = FullPush(str(tmp_path))
        learn_push(engine, 0, str(tmp_path))
        for state, _ in servers:
            state.label = version_label(RUN, 0)
        first_turns = [(10 + episode, 11) for episode in range(4)]
        for prompt in first_turns:
            engine._generate(RolloutRequest(prompt, 1, REQUEST.options, seed=0, oldest_step=0))
        # each first turn was new: spread in turn; each next turn (its prompt, the sampled token 1, a reply) follows it
        assert [state.prompts for state, _ in servers] == [[first_turns[0], first_turns[2]], [first_turns[1], first_turns[3]]]
        for prompt in reversed(first_turns):
            engine._generate(RolloutRequest((*prompt, 1, 7, 8), 1, REQUEST.options, seed=0, oldest_step=0))
        for state, _ in servers:
            firsts, nexts = state.prompts[:2], state.prompts[2:]
            assert sorted(next_turn[:2] for next_turn in nexts) == sorted(firsts)
        assert engine.routes.taken_routed_tokens() == 4 * 3  # each next turn's prompt and sampled token were on its server


def test_prefix_routes_take_the_longest_remembered_prefix_retry_in_turn_and_forget_the_oldest():
    routes = PrefixRoutes(keep=3)
    assert [routes.choose((1, 2), 2), routes.choose((3,), 2)] == [0, 1]
    routes.remember((1, 2), [(5,)], 1)  # (1, 2) and (1, 2, 5) on server 1
    routes.remember((1,), [], 0)  # (1,) on server 0: a shorter prefix of the same prompts
    assert routes.choose((1, 2, 5, 9), 2) == 1 and routes.taken_routed_tokens() == 3
    assert routes.choose((1, 4), 2) == 0 and routes.taken_routed_tokens() == 1
    assert routes.choose(None, 2) == 0  # a retry: the next in turn, whatever is remembered
    routes.remember((7,), [], 1)  # a fourth sequence: (1, 2), the oldest, is forgotten
    assert routes.choose((1, 2, 9), 2) == 0  # (1,) is still remembered, on server 0
    assert routes.choose((1, 2, 5), 2) == 1


def lora_policy(step: int = 0) -> PolicyWeights:
    model = LoRA(rank=2, target_modules=["q_proj", "v_proj"]).apply(load_causal_lm("embedded:tiny-adder"))
    return PolicyWeights(ModelRoot(model), None, step, torch.device("cpu"))


def adapter_engine(urls: list[str], tmp_path, max_staleness: int) -> VLLMServerEngine:
    engine = VLLMServerEngine(urls=urls, server_timeout=30, max_staleness=max_staleness, weights_dir=str(tmp_path))
    engine.start(lora_policy())
    return engine


def test_a_lora_run_gives_each_server_the_base_weights_once_then_adapters_without_pausing_keeping_max_staleness_plus_one(tmp_path):
    with stand_in_servers(2) as servers:
        engine = adapter_engine([url for _, url in servers], tmp_path, max_staleness=1)
        policy = lora_policy()
        base_bytes, adapter_bytes = lora_sizes(policy.model)
        for step in range(3):
            engine.sync(PolicyWeights(policy.root, None, step, policy.device))
        labels = [version_label(engine.run, push) for push in range(3)]
        for server, _ in servers:
            assert (server.label, server.reloads, server.pauses) == (f"{engine.run}/base", [str(tmp_path / f"{engine.run}-base")], 1)
            assert server.adapter_loads == labels
            assert sorted(server.adapters) == labels[1:]  # the newest max_staleness + 1 versions
        assert sorted(os.listdir(tmp_path)) == sorted(f"{label.replace('/', '-')}" for label in [f"{engine.run}/base", *labels[1:]])
        assert engine.pushes.pushed_bytes == {"base": base_bytes, "adapter": 3 * adapter_bytes}

        result = engine._generate(REQUEST)  # named with the current version's adapter, whose step it reports
        assert [server.sampled_with for server, _ in servers] == [[labels[2]], []] and result.step == 2
        servers[1][0].adapters["other/0"] = "another run's"
        engine.close()  # this run's adapters are unloaded, another run's stay
        assert [server.adapters for server, _ in servers] == [{}, {"other/0": "another run's"}]


def test_a_restarted_server_gets_the_base_weights_and_the_current_adapter_before_it_samples(tmp_path):
    with stand_in_servers(1) as [(server, url)]:
        engine = adapter_engine([url], tmp_path, max_staleness=0)
        policy = lora_policy()
        for step in range(2):
            engine.sync(PolicyWeights(policy.root, None, step, policy.device))
        server.restart()
        assert engine._generate(REQUEST).step == 1
        current = version_label(engine.run, 1)
        assert (server.label, server.reloads[-1], list(server.adapters), server.sampled_with) == (
            f"{engine.run}/base", str(tmp_path / f"{engine.run}-base"), [current], [current]
        )


def test_a_lora_run_refuses_at_start_up_a_server_that_cannot_load_adapters_unless_it_pushes_merged_weights():
    with stand_in_servers(1) as [(server, url)]:
        VLLMServerEngine(urls=[url]).check(lora_policy(), None)
        server.loads_adapters = False
        with pytest.raises(ValueError, match=f"engine.init_args.urls: the server at {url} does not load LoRA adapters at run time"):
            VLLMServerEngine(urls=[url]).check(lora_policy(), None)
        VLLMServerEngine(urls=[url], push_adapters=False).check(lora_policy(), None)
        VLLMServerEngine(urls=[url]).check(PolicyWeights(ModelRoot(load_causal_lm("embedded:tiny-adder")), None, 0, torch.device("cpu")), None)

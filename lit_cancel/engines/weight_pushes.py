"""How :class:`~lit_cancel.engines.vllm_servers.VLLMServerEngine` brings the policy's weights to its servers: the whole
model each version (:class:`FullPush`), or, for a LoRA policy, the base weights once per server and then each version's
adapter (:class:`AdapterPush`).

Both write a version where every server can read it (process 0 writes; under FSDP2 every process takes part in each
gather), have every server load it at once, and give a server that lacks the current version (one that restarted, was
down, or stopped half-way through a transfer) that version before it samples.
"""

import contextlib
import os
import shutil
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import Tensor

from lit_cancel.engines.adapters import write_adapter
from lit_cancel.engines.base import PolicyWeights, in_background
from lit_cancel.engines.launched_server import write_weights
from lit_cancel.engines.server_messages import RolloutRequest, base_label, holds_older, version_label, version_push
from lit_cancel.engines.server_process import ServerClient, ServerError
from lit_cancel.engines.vllm_common import PushedBytes, counted, merged_weights


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def on_every_server(load, clients: list[ServerClient]) -> None:
    """``load(client)`` for every server, all at once; a server that is down is skipped: it gets the current version
    when it answers again (:meth:`FullPush.ready`, :meth:`AdapterPush.ready`)."""
    for loading in [in_background(load, client) for client in clients]:
        try:
            loading.result()
        except ServerError:
            pass


def push_weights(weights: Iterable[tuple[str, Tensor]], folder: str, label: str, clients: list[ServerClient]) -> None:
    """Process 0 writes ``weights`` to ``folder`` and has every server load them as the version ``label``
    (:func:`on_every_server`); the other processes take part in each gather of a sharded weight and keep nothing. The
    servers load once every process is here, so no process samples with the weights they replace any more
    (VLLMServerEngine.sync finished its draws first). Returns once every process is done."""
    if _rank() == 0:
        write_weights(weights, folder)
    else:
        deque(weights, maxlen=0)
    _barrier()
    if _rank() == 0:
        on_every_server(lambda client: client.load_weights(folder, label), clients)
    _barrier()


class FullPush:
    """Every version is the whole model (LoRA adapters merged), loaded by each server while it pauses: draws that sample
    with the weights a server holds finish before a push (``pauses``).

    Args:
        weights_dir: the folder the servers read versions from.
    """

    pauses = True

    def __init__(self, weights_dir: str):
        self.weights_dir = weights_dir
        self.current: tuple[str, str] | None = None  # the current version's label and folder
        self.pushed_bytes = PushedBytes()

    def push(self, policy: PolicyWeights, dtype: torch.dtype, label: str, clients: list[ServerClient]) -> None:
        """Writes the policy's weights as version ``label`` and has every server load it; the version before is deleted."""
        folder = os.path.join(self.weights_dir, label.replace("/", "-"))
        push_weights(counted(merged_weights(policy.model, dtype), self.pushed_bytes, "merged"), folder, label, clients)
        previous, self.current = self.current, (label, folder)
        if _rank() == 0 and previous is not None:
            shutil.rmtree(previous[1], ignore_errors=True)

    def close(self, clients: list[ServerClient]) -> None:
        """Nothing: a server keeps the last version's weights (a server holds one model)."""

    def ready(self, client: ServerClient, request: RolloutRequest) -> RolloutRequest:
        """``request`` as sent to ``client``, which first gets the current version where it holds an older one
        (:func:`holds_older`)."""
        label, folder = self.current
        if holds_older(client.label(), label):
            client.load_weights(folder, label)
        return request


class AdapterPush:
    """A LoRA policy's versions as adapters: a server gets the base weights once (again after a restart), then each
    version's adapter, loaded while it samples (no pause); at each push a server unloads this run's adapters older than
    the newest ``keep``. A request names the adapter it samples with. What a server holds is read from the server (its
    weights' label, its loaded adapters), so every trainer process agrees on it.

    Args:
        weights_dir: the folder the servers read the base weights and adapters from.
        run: the run's id: its base weights are labelled ``{run}/base`` on a server.
        keep: adapter versions a server keeps loaded, ``max_staleness + 1``: a draw sampled ahead finishes with its own.
    """

    pauses = False

    def __init__(self, weights_dir: str, run: str, keep: int):
        self.weights_dir, self.run, self.keep, self.base = weights_dir, run, keep, base_label(run)
        self.current: tuple[str, str] | None = None
        self.base_written = False  # the same in every process: each takes part in the base weights' gathers
        self.locks: dict[str, threading.Lock] = {}
        self.pushed_bytes = PushedBytes()

    def _folder(self, label: str) -> str:
        return os.path.join(self.weights_dir, label.replace("/", "-"))

    def push(self, policy: PolicyWeights, dtype: torch.dtype, label: str, clients: list[ServerClient]) -> None:
        """Writes the base weights (the first time) and the adapter of version ``label``, then has every server load what
        it lacks and unload the adapters beyond ``keep``, whose folders are deleted."""
        writes = _rank() == 0
        if not self.base_written:
            base = counted(merged_weights(policy.model, dtype, adapters=False), self.pushed_bytes, "base")
            if writes:
                write_weights(base, self._folder(self.base))
            else:
                deque(base, maxlen=0)  # taking part in each gather of a sharded weight
            self.base_written = True
        self.pushed_bytes.add("adapter", write_adapter(policy.model, self._folder(label), dtype, write=writes))
        _barrier()
        self.current = (label, self._folder(label))
        if writes:
            on_every_server(lambda client: self._load(client, unload=True), clients)
            shutil.rmtree(self._folder(version_label(self.run, version_push(label) - self.keep)), ignore_errors=True)
        _barrier()

    def ready(self, client: ServerClient, request: RolloutRequest) -> RolloutRequest:
        """``request`` addressed to the current version's adapter on ``client``, which first gets the base weights where it
        holds others (a new or restarted server) and the adapter where it lacks it."""
        return replace(request, adapter=self._load(client))

    def close(self, clients: list[ServerClient]) -> None:
        """Unloads this run's adapters from the servers that answer at once: a server may serve other runs."""
        for client in clients if _rank() == 0 else ():
            with contextlib.suppress(ServerError):
                for name in client.adapters() if client.healthy() else ():
                    if name.startswith(f"{self.run}/"):
                        client.unload_adapter(name, timeout=5)

    def _load(self, client: ServerClient, unload: bool = False) -> str:
        label, folder = self.current
        with self.locks.setdefault(client.url, threading.Lock()):
            if client.label() != self.base:
                client.load_weights(self._folder(self.base), self.base)
            held = client.adapters()
            if label not in held:
                client.load_adapter(label, folder)
            oldest_kept = version_push(label) - self.keep + 1
            for old in held if unload else ():
                if old.startswith(f"{self.run}/") and version_push(old) < oldest_kept:
                    client.unload_adapter(old)
        return label

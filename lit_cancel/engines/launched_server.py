"""A vLLM server that the trainer starts on its own machine for :class:`~lit_cancel.engines.vllm_servers.VLLMServerEngine`
(``launch: true``), and the folders of weights the trainer writes for its servers."""

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch
from torch import Tensor

from lit_cancel.engines.base import PolicyWeights
from lit_cancel.engines.server_process import ServerClient, free_port, server_command, start_server, stop_server, wait_until_healthy
from lit_cancel.engines.vllm_common import CPU_KV_CACHE, INSTALL_LINES, kv_cache_need, kv_cache_refusal, merged_weights

_ENGINE_KEY = "model.init_args.engine.init_args"


def write_weights(weights: Iterable[tuple[str, Tensor]], folder: str) -> None:
    """Writes ``weights``, ``(name, tensor)`` pairs such as :func:`~lit_cancel.engines.vllm_common.merged_weights`
    yields, as ``folder/model.safetensors``, whole or not at all (written aside, then renamed). Each tensor is moved to
    host memory as it comes: a GPU holds one of them at a time."""
    from safetensors.torch import save_file

    seen, tensors = set(), {}
    for name, tensor in weights:
        tensor = tensor.to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor  # tied weights share one
        seen.add(storage)
    partial = f"{folder}.partial"
    os.makedirs(partial, exist_ok=True)
    save_file(tensors, os.path.join(partial, "model.safetensors"))
    os.replace(partial, folder)


def kv_cache_options(server_args: list[str]) -> dict:
    """The options in a server's command-line arguments that shape its KV cache, by vLLM's engine argument names."""
    options, words = {}, iter(server_args)
    for word in words:
        name, _, value = word.partition("=")
        if name in ("--block-size", "--kv-cache-dtype", "--hf-overrides"):
            value = value or next(words, "")
            options[name[2:].replace("-", "_")] = int(value) if name == "--block-size" and value.isdigit() else value
    return options


class LaunchedServer:
    """One vLLM server on 127.0.0.1 for the policy: started from a folder holding its configuration, tokenizer, weights
    and temporary files, stopped with every process of its group (by its watchdog when the trainer's process was killed);
    while it runs the trainer's process may keep to ``trainer_cpus``.

    Args:
        server_cpus: the server's CPU cores; None: vLLM's own choice.
        trainer_cpus: the cores the trainer's process keeps to while the server runs; None: unchanged.
        startup_timeout: seconds the server may take to answer ``/health``.
        max_model_len: the server's longest prompt plus completion; None: the model's.
        kv_cache_memory_bytes: the server's KV cache; None: 1 GiB without a GPU, vLLM's choice on one.
        server_args: further ``vllm serve`` arguments.
    """

    def __init__(self, server_cpus: list[int] | None, trainer_cpus: list[int] | None, startup_timeout: float,
                 max_model_len: int | None, kv_cache_memory_bytes: int | None, server_args: list[str]):
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(f"VLLMServerEngine with launch: true starts a vLLM server here, and vLLM is not installed: "
                              f"{INSTALL_LINES}; or give the urls of servers started elsewhere")
        self.server_cpus, self.trainer_cpus, self.startup_timeout = server_cpus, trainer_cpus, startup_timeout
        self.max_model_len, self.kv_cache_memory_bytes, self.server_args = max_model_len, kv_cache_memory_bytes, server_args
        self.process = None
        self.folder: str | None = None
        self._trainer_placement: tuple[set[int], int] | None = None

    def check(self, policy: PolicyWeights, dtype: str, max_new_tokens: int | None) -> None:
        """Raises ValueError, in one line, where no GPU is and the KV cache cannot hold one sequence of ``max_model_len``
        tokens (:func:`~lit_cancel.engines.vllm_common.kv_cache_need`): the server would refuse to start; and on a GPU
        unless ``server_args`` give the server's share of it."""
        if torch.cuda.is_available():  # checked before the module is on its device: the server will run on the GPU
            if not any(arg.split("=")[0] == "--gpu-memory-utilization" for arg in self.server_args):
                raise ValueError(
                    f"{_ENGINE_KEY}.launch starts a vLLM server on the trainer's GPU, which by default takes 90% of it: give its "
                    f"share in {_ENGINE_KEY}.server_args, e.g. [--gpu-memory-utilization, '0.3'], or sample in the trainer's "
                    "process with lit_cancel.VLLMEngine (sleep mode gives training the GPU back between rollouts)"
                )
            return
        need = kv_cache_need(policy.base_model.config, policy.tokenizer, dtype, self.max_model_len, kv_cache_options(self.server_args))
        budget = self.kv_cache_memory_bytes or CPU_KV_CACHE
        if need is not None and budget < need[0]:
            raise ValueError(kv_cache_refusal(
                need, budget, self.kv_cache_memory_bytes is not None, self.max_model_len is not None,
                f"{_ENGINE_KEY}.kv_cache_memory_bytes", f"{_ENGINE_KEY}.max_model_len", max_new_tokens,
            ))

    def start(self, policy: PolicyWeights, dtype: str, adapter_args: list[str] | None = None) -> str:
        """Starts the server on the policy's current weights in ``dtype`` (with ``adapter_args``, those of
        :func:`~lit_cancel.engines.adapters.adapter_server_args`: loading a LoRA run's adapters); returns its URL once it
        answers."""
        self.folder = folder = tempfile.mkdtemp(prefix="lit-cancel-server-")
        policy.base_model.config.save_pretrained(folder)
        policy.tokenizer.save_pretrained(folder)
        write_weights(merged_weights(policy.model, getattr(torch, dtype)), os.path.join(folder, "weights"))
        os.replace(os.path.join(folder, "weights", "model.safetensors"), os.path.join(folder, "model.safetensors"))
        on_cpu = policy.device.type == "cpu"
        kv_bytes = self.kv_cache_memory_bytes or (CPU_KV_CACHE if on_cpu else None)
        port = free_port()
        server_args = [*(adapter_args or []), *self.server_args]
        command = server_command(folder, "127.0.0.1", port, dtype, self.max_model_len, kv_bytes, on_cpu, server_args)
        log_path = os.path.join(folder, "server.log")
        self.process = start_server(command, self.server_cpus, log_path, folder)
        if self.trainer_cpus:
            self._trainer_placement = os.sched_getaffinity(0), torch.get_num_threads()
            os.sched_setaffinity(0, self.trainer_cpus)
            torch.set_num_threads(len(self.trainer_cpus))
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(ServerClient(url), self.process, self.startup_timeout, log_path)
        return url

    def stop(self) -> None:
        """Stops every process of the server (also when its own process died), gives the trainer's process back the cores
        and threads it had, and removes the server's folder."""
        if self.process is not None:
            stop_server(self.process)
        self.process = None
        if self._trainer_placement is not None:
            os.sched_setaffinity(0, self._trainer_placement[0])
            torch.set_num_threads(self._trainer_placement[1])
            self._trainer_placement = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

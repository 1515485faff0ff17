"""Rollout engines: what samples completions for the policy.

* :mod:`~lit_cancel.engines.base`: the typed interface (:class:`SamplingOptions`, :class:`SampleRequest`,
  :class:`PolicyWeights`, :class:`Sampled`, :class:`RolloutEngine`).
* :mod:`~lit_cancel.engines.decode_loop`: :class:`DecodeLoop` (the default) and :class:`HFGenerate`, which run the
  policy itself.
* :mod:`~lit_cancel.engines.vllm_colocated`: ``VLLMEngine``, a vLLM engine in the training process.
* :mod:`~lit_cancel.engines.vllm_servers`: ``VLLMServerEngine``, vLLM servers the weights are pushed to, with
  :mod:`~lit_cancel.engines.server_process` (starting a server, its HTTP client),
  :mod:`~lit_cancel.engines.server_watchdog` (stopping a server's processes, also once its trainer was killed),
  :mod:`~lit_cancel.engines.server_messages` (a request and its result) and
  :mod:`~lit_cancel.engines.launched_server` (a server the trainer starts itself).
* :mod:`~lit_cancel.engines.vllm_common`: what both vLLM engines share (sampling options, seeds, weights, KV cache).

The vLLM modules import vLLM only where they use it: import them by their full names.
"""

from lit_cancel.engines.base import PolicyWeights, RolloutEngine, Sampled, SampleRequest, SamplingOptions
from lit_cancel.engines.decode_loop import DecodeLoop, HFGenerate

__all__ = ["DecodeLoop", "HFGenerate", "PolicyWeights", "RolloutEngine", "SampleRequest", "Sampled", "SamplingOptions"]

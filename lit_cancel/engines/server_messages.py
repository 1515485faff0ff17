"""The message between the trainer and a rollout server: one group in, its completions and weights version out.

A request is one prompt's whole group (``n`` samples in one request), so every member of a group is
sampled by the same weights: the condition under which a token-level correction of stale rollouts
keeps shared tokens cancelling. The trainer labels every weights version it pushes
``"{run}/{push}"`` (the run's id and a count of its pushes) and remembers the optimizer step of
each; the server reports, per completion, the labels of the weights that sampled its tokens.
:func:`parse_result` refuses a group whose tokens span two labels, or whose label this run did not push.

In vLLM's terms the request is the body of ``POST /inference/v1/generate`` (token ids in, token ids
and per-token log-probs out) and the label is the weights version set by ``POST /update_weight_version``.

A LoRA run pushing adapters labels the base weights ``"{run}/base"`` and names each version's adapter by its label; a
request names the adapter it samples with (the body's ``model``), and its completions count as that version's.
"""

from dataclasses import dataclass

# the suffix of a label while the weights under it are being replaced
LOADING = ":loading"


class StaleRolloutError(RuntimeError):
    """A server returned completions from weights this run did not push, or older than the request allows."""


@dataclass(frozen=True)
class ServerSampling:
    """How to sample: the module's options and the ``generation_kwargs`` the server honours, in vLLM's names."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    greedy: bool = False
    extra: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class RolloutRequest:
    """``num_samples`` completions of one prompt, seeded, from weights of step ``oldest_step`` or later."""

    prompt_ids: tuple[int, ...]
    num_samples: int
    options: ServerSampling
    seed: int | None
    oldest_step: int
    adapter: str | None = None
    """The LoRA adapter (a version's label) the server samples with; None: the server's weights alone."""

    def body(self) -> dict:
        """The JSON body of vLLM's token-in/token-out generate route."""
        options = self.options
        params = {
            "n": self.num_samples,
            "temperature": 0.0 if options.greedy else options.temperature,
            "top_p": 1.0 if options.greedy else options.top_p,
            "max_tokens": options.max_new_tokens,
            "stop_token_ids": list(options.stop_token_ids),
            "detokenize": False,
            **({} if options.greedy else {"logprobs": 0, "seed": self.seed}),
            **dict(options.extra),
        }
        return {"token_ids": list(self.prompt_ids), "sampling_params": params, **({"model": self.adapter} if self.adapter else {})}


@dataclass
class RolloutResult:
    """The completions of one request, each with its sampled tokens' log-probs (None when greedy), and the step
    of the weights that sampled them."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    step: int


def version_label(run: str, push: int) -> str:
    """The label the trainer gives the weights of its ``push``-th push in run ``run``."""
    return f"{run}/{push}"


def base_label(run: str) -> str:
    """The label of run ``run``'s base weights on a server that takes its versions as adapters."""
    return f"{run}/base"


def version_push(label: str) -> int:
    """The count of pushes in a label :func:`version_label` made: which of its run's versions it is."""
    return int(label.rpartition("/")[2])


def holds_older(server_label: str, label: str) -> bool:
    """Whether a server whose weights are labelled ``server_label`` should load the version ``label`` (of a run, as
    :func:`version_label` makes it): it holds another run's weights or its start-up ones (a restarted server's), an older
    version of the run, or ``label`` half-loaded (a transfer that stopped half-way). Not ``label`` itself, nor a newer
    version, whole or being loaded: that is another process's push, which one still at ``label`` must not undo (a process
    loads a version while every process holds the one before it, or once it holds it itself)."""
    run = label.rpartition("/")[0]
    if not server_label.startswith(f"{run}/"):
        return True
    return server_label != label and version_push(server_label.removesuffix(LOADING)) <= version_push(label)


def parse_result(response: dict, request: RolloutRequest, pushed: dict[str, int], server: str) -> RolloutResult:
    """The completions in a generate response, checked: ``num_samples`` of them, each sampled entirely by one version
    of the weights ``pushed`` (label: optimizer step), the same for all, of step ``request.oldest_step`` or later;
    else :class:`StaleRolloutError`."""
    choices = sorted(response.get("choices", []), key=lambda choice: choice["index"])
    if len(choices) != request.num_samples:
        raise StaleRolloutError(f"{server} returned {len(choices)} completions for a request of {request.num_samples}")
    labels = set()
    for choice in choices:
        spans = choice.get("weight_versions") or []
        labels |= {span["version"] for span in spans}
        if not spans and choice["token_ids"]:
            raise StaleRolloutError(f"{server} does not report weights versions; it needs vLLM 0.32 or later")
    if len(labels) != 1:
        raise StaleRolloutError(
            f"{server} sampled one group with weights {sorted(labels)}: a group must come from one weights version"
        )
    label = labels.pop()
    if request.adapter is not None:  # the base weights sampled with the version's adapter
        if label != base_label(request.adapter.rpartition("/")[0]):
            raise StaleRolloutError(f"{server} sampled with base weights labelled {label!r}, not this run's")
        label = request.adapter
    step = pushed.get(label)
    if label.endswith(LOADING):
        raise StaleRolloutError(f"{server} sampled while its weights were being replaced (label {label!r}): a transfer did not complete")
    if step is None:
        raise StaleRolloutError(f"{server} sampled with weights labelled {label!r}, which this run did not push")
    if step < request.oldest_step:
        raise StaleRolloutError(
            f"{server} sampled with the weights of step {step}, older than step {request.oldest_step} that the request allows"
        )
    completions = [list(choice["token_ids"]) for choice in choices]
    logprobs = None
    if not request.options.greedy:
        logprobs = [[entry["logprob"] for entry in choice["logprobs"]["content"]] for choice in choices]
    return RolloutResult(completions, logprobs, step)

"""Which of several vLLM servers a request goes to: back to the server that sampled its prefix, else the next in turn.

An agent's turn continues its episode: its prompt is the last turn's prompt, the tokens sampled for it and the
environment's reply. A vLLM server keeps the blocks of what it prefilled and sampled (prefix caching), so the next turn
prefills only the reply there, and the whole context on any other server. :class:`PrefixRoutes` remembers, for each
request a server answered, its prompt and each of its completions appended to it, by that server; a request whose prompt
starts with a remembered sequence goes to that sequence's server (the longest match). Requests with nothing
remembered, every first turn and every single-turn prompt, are spread over the servers in turn, as before.
"""

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence


class PrefixRoutes:
    """The servers' remembered sequences, and the turn of the next request that matches none.

    Args:
        keep: sequences remembered at most (the oldest forgotten first): a round's requests and their completions.

    Example::

        routes = PrefixRoutes()
        server = routes.choose(prompt_ids, servers=2)  # 0 (nothing remembered: the next in turn)
        routes.remember(prompt_ids, completions, server)
        routes.choose(prompt_ids + completions[0] + reply_ids, servers=2)  # the same server
    """

    def __init__(self, keep: int = 8192) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.where: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash of the sequence) -> server
        self.lengths: Counter[int] = Counter()
        self.next_server = -1
        self.routed_tokens = 0
        self.lock = threading.Lock()

    def choose(self, prompt_ids: Sequence[int] | None, servers: int) -> int:
        """The server for a request with ``prompt_ids``: the one that sampled its longest remembered prefix, else the
        next in turn; None for ``prompt_ids`` (a retry after a server failed): the next in turn."""
        with self.lock:
            if prompt_ids is not None:
                prompt = tuple(prompt_ids)
                for length in sorted((n for n in self.lengths if n <= len(prompt)), reverse=True):
                    server = self.where.get((length, hash(prompt[:length])))
                    if server is not None and server < servers:
                        self.routed_tokens += length
                        return server
            self.next_server = (self.next_server + 1) % servers
            return self.next_server

    def remember(self, prompt_ids: Sequence[int], completions: Sequence[Sequence[int]], server: int) -> None:
        """``server`` answered a request with ``prompt_ids``: its prompt and each completion after it are in its cache."""
        prompt = tuple(prompt_ids)
        with self.lock:
            for sequence in (prompt, *(prompt + tuple(completion) for completion in completions)):
                key = (len(sequence), hash(sequence))
                if key not in self.where:
                    self.lengths[len(sequence)] += 1
                self.where[key] = server
                self.where.move_to_end(key)
            while len(self.where) > self.keep:
                (length, _), _ = self.where.popitem(last=False)
                self.lengths[length] -= 1
                if not self.lengths[length]:
                    del self.lengths[length]

    def taken_routed_tokens(self) -> int:
        """Prompt tokens sent to the server that sampled them since the last call (what its prefix cache can serve)."""
        with self.lock:
            routed, self.routed_tokens = self.routed_tokens, 0
        return routed

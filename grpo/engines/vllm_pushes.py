"""Weight pushes queued at a `grpo vllm-serve` server, so that with `max_staleness: k` the server generates rollouts
t + 1 .. t + k while the trainer updates on rollout t (grpo.training.rollout.pipeline_server).

A lagged trainer pushes the weights of step t as soon as it has them (`/update_weights?...&queued=1`), while the
server may still be generating rollouts that name older weights. The server does not load them then: it reads the
push into host memory (the staged version; at most one: a second push waits until the first is loaded, so the
trainer's push blocks and host memory holds one version) and answers. The staged weights are loaded, between
requests, by the first request that names their step (or names none: an evaluation, the synchronous path); a
request that names the weights the engine holds runs on them, and any other is refused (HTTP 409), so each rollout
is still sampled with exactly the weights it names. Requests name their weights in the order the trainer asked for
them, and the versions only grow, so applying a push when the first request for it comes is applying it in order.

A push that is not queued (the synchronous path, a trainer's first push) loads at once, as before, and drops a
staged version (an earlier trainer's, which nothing will ask for).
"""

from __future__ import annotations

import threading


class PushQueue:
    """The staged push of a server. Its own lock, not the engine's: a push is received while a request generates
    (`apply_for` and `drop` run under the engine's lock and take this one inside it, `stage` takes this one only)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.staged: tuple[int | None, list] | None = None  # (step, [(name, host tensor), ...])
        self.receiving = False

    def wait_free(self) -> None:
        """Return once no push is staged or being read. A trainer about to broadcast a queued push over its process
        group asks this first (`/wait_unstaged`): the wait for the slot, as long as the requests before it take,
        then happens over HTTP, which has no timeout, and not inside the group's broadcast, which has one
        (vllm_server_timeout)."""
        with self.cond:
            self.cond.wait_for(lambda: self.staged is None and not self.receiving)

    def stage(self, weights, step: int | None, state: dict) -> None:
        """Read the pushed (name, tensor) pairs (each bucket of them already on the host) and hold them until a
        request for `step` comes; first wait until an earlier staged push has been loaded."""
        with self.cond:
            self.cond.wait_for(lambda: self.staged is None and not self.receiving)
            self.receiving = True
        try:
            held = list(weights)  # (views of each bucket's host buffer: the buffers stay alive with them)
        finally:
            with self.cond:
                self.receiving = False
                self.cond.notify_all()
        with self.cond:
            self.staged = (step, held)
            state["weights_version"] += 1
            state["staged_step"] = step

    def apply_for(self, engine, state: dict, step: int | None) -> None:
        """Before a request for the weights of `step` (None: whatever is newest), holding the engine's lock: load the
        staged push if the request names it (or names none)."""
        with self.cond:
            if self.staged is None or (step is not None and step != self.staged[0]):
                return
            staged_step, weights = self.staged
        engine.load_weights(iter(weights))
        with self.cond:  # (only now may the next push be read: one version in host memory)
            self.staged = None
            state["policy_step"], state["staged_step"] = staged_step, None
            self.cond.notify_all()

    def drop(self, state: dict) -> None:
        """A push that loads at once (holding the engine's lock): the staged version, if any, is older."""
        with self.cond:
            self.staged = None
            state["staged_step"] = None
            self.cond.notify_all()

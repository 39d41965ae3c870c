"""Rollouts generated ahead of the update by a fixed lag (grpo.training.rollout.sources picks the run's source).

    LaggedRollouts   max_staleness k > 0: a rollout worker, a forked process with its own copy of the model,
                     generates and scores rollout t with exactly the weights the trainer had when it began rollout
                     t - k (optimizer step (t - k) x steps per rollout; the first k rollouts with the initial
                     weights), while the trainer updates on rollout t - 1 ... t - k.
    ServerRollouts   the same schedule with a `grpo vllm-serve` server generating (use_vllm, vllm_mode: server):
                     grpo.training.rollout.pipeline_server.

The lag is fixed, not "as fresh as timing allows", so the run is a function of the seed and k: the prompts are drawn
in the trainer's process in rollout order (the same prompts as a synchronous run's rollout t; with dynamic sampling,
whose refills depend on the rollout's rewards, by the worker, in the same order), each row keeps its
seed (grpo.engines.base.row_seed), and every request goes to the worker right after the weights it names, over one
ordered pipe, as soon as a rollout's last optimizer step is taken. The trainer's process keeps what needs every
process or the current weights (advantages over all groups, the proximal pass, the update); the worker generates,
scores and takes the reference's log-probs of its process's rows.

A checkpoint keeps the rollouts asked for and not yet trained on, so a resumed run trains on the same ones: those
of older weights (which the checkpoint no longer holds) generated, the one of its own weights as its request.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import torch

from grpo.agents.worker import fork, leave_stops_to_the_trainer
from grpo.config import ConfigError
from grpo.training.rollout.assembly import rollout_routes, rollout_tensors
from grpo.training.rollout.batch import RolloutBatch, SampleRequest, Sampled
from grpo.training.rollout.messages import Answer, Failure, Generate, Stop, Weights
from grpo.training.rollout.rollouts import Rollouts


class LaggedRollouts:
    """Rollouts from a worker process, each generated with the weights of `lag` rollouts before (module docstring).

    Per rollout it adds pipeline/ metrics: the optimizer steps between its weights and the step it starts
    (`staleness`), the seconds the trainer waited for it (`trainer_idle`) and the worker waited before starting it
    (`generator_idle`), and its weights' version (optimizer steps taken when they were sent)."""

    def __init__(self, rollouts: Rollouts, policy, lag: int, rollout_steps: int, total_rollouts: int,
                 reference=None):
        self.rollouts, self.policy, self.lag, self.reference = rollouts, policy, lag, reference
        self.rollout_steps, self.total_rollouts = rollout_steps, total_rollouts
        self.dynamic = rollouts.cfg.dynamic_sampling  # (one process, one optimizer step per rollout: validated)
        self.layout = (f"a rollout worker process {lag} rollout(s) ahead (max_staleness {lag}): rollout t from the "
                       f"weights of optimizer step (t - {lag}) x {rollout_steps}, generated, scored"
                       f"{' and its reference log-probs taken' if reference else ''} while the update runs")
        self.requested = 0  # rollouts asked for (sent, or kept by a checkpoint), in order
        self.ready: dict[int, tuple] = {}  # index -> (Sampled fields, logs, info), not yet trained on
        self.in_flight: dict[int, tuple] = {}  # index -> (weights version, SampleRequest): sent, no answer taken
        self.pushed: int | None = None  # version of the weights the worker has, None until first sent
        self.step = 0  # optimizer steps the trainer has taken
        self.worker: _Worker | None = None
        self.lost: set[int] = set()  # rollouts in flight when the worker was stopped

    def start(self) -> None:
        """Fork the worker; after a resume, send again the requests the checkpoint kept as recipes (their weights
        are the checkpoint's, which the worker starts from)."""
        if self.worker is None:
            self.worker = self._make_worker()
            self.pushed = None
            for index, (version, request) in sorted(self.in_flight.items()):
                self._send_weights(version)
                self.worker.send(Generate(index, version, request))

    def _make_worker(self):
        return _Worker(self.rollouts, self.policy, self.reference)

    def close(self) -> None:
        """Stop the worker. A run that ends normally has nothing in flight (nothing is asked for past the last
        rollout); one stopped early loses what was (a checkpoint would have kept it)."""
        if self.worker is not None:
            self.lost |= set(self.in_flight)
            self.in_flight = {}
            self.worker.stop()
            self.worker = None

    def stepped(self, step: int) -> None:
        """After each optimizer step: when a rollout has fed all its steps, the weights and the next request go to
        the worker at once, so it generates during the step's logging, evaluation and checkpoint too."""
        self.step = step
        if step % self.rollout_steps == 0:
            self._ask(step // self.rollout_steps)

    def _ask(self, index: int) -> None:
        """Send the requests up to rollout index + lag, the last with the weights of now (rollout `index` begins)."""
        last = min(index + self.lag, self.total_rollouts - 1)
        if self.requested > last:
            return
        self._send_weights(index * self.rollout_steps)
        while self.requested <= last:
            # (dynamic sampling: the refills depend on the rollout's rewards, so the worker draws its prompts)
            request = self.requested if self.dynamic else self.rollouts.request(
                self.rollouts.prompts.next(self.rollouts.B), self.requested)
            self.in_flight[self.requested] = (self.pushed, request)
            self.worker.send(Generate(self.requested, self.pushed, request))
            self.requested += 1

    def _send_weights(self, version: int) -> None:
        if self.pushed != version:
            self.worker.send(Weights(version, _trainable(self.policy)))
            self.pushed = version

    def _take(self, index: int) -> tuple:
        """Rollout `index`'s answer (rollouts are taken in index order). With dynamic sampling this process's prompt
        stream moves to where the worker's was after drawing it: what a checkpoint keeps, from which a resumed
        worker draws the rollouts kept as recipes again."""
        self.in_flight.pop(index, None)
        answer = self.worker.result(index)
        if "prompts" in answer[1]:
            self.rollouts.prompts.load_state_dict(answer[1]["prompts"])
        return answer

    def next(self, index: int) -> RolloutBatch:
        """Rollout `index` (its request, and those up to index + lag, sent now unless `stepped` sent them)."""
        if index in self.lost:
            raise RuntimeError(f"rollout {index} was in flight when the last train() stopped early; resume from a "
                               "checkpoint (which keeps the rollouts generated ahead) instead.")
        self._ask(index)
        t0 = time.perf_counter()
        fields, logs, info = self.ready.pop(index) if index in self.ready else self._take(index)
        waited = time.perf_counter() - t0
        self.rollouts.take_logs(logs)
        batch = self.rollouts.finish(Sampled(**fields), logs.get("sampling", {}), index)
        batch.ref_logp = info.get("ref_logp")  # (None: the trainer's process takes them)
        version = index * self.rollout_steps  # optimizer steps taken when rollout `index` starts feeding the update
        batch.metrics.update({"pipeline/staleness": float(version - info["version"]),
                              "pipeline/weight_version": float(info["version"]),
                              "pipeline/trainer_idle": waited, "pipeline/generator_idle": info["idle"]})
        return batch

    def state_dict(self) -> dict:
        """The rollouts asked for and not yet trained on: generated (the checkpoint waits for those of older
        weights, which it does not hold) or, for those of the weights it holds, their requests (a recipe)."""
        recipes = {i: (v, r if isinstance(r, int) else vars(r)) for i, (v, r) in self.in_flight.items()
                   if v == self.step}
        for index in sorted(set(self.in_flight) - set(recipes)):
            self.ready[index] = self._take(index)
        return {"lag": self.lag, "requested": self.requested, "ready": dict(self.ready), "recipes": recipes}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        if state["lag"] != self.lag and (state["ready"] or state.get("recipes")):
            raise ConfigError(f"resume_from_checkpoint: the checkpoint was written with max_staleness: "
                              f"{state['lag']} and holds the rollouts it had asked for ahead; resume with "
                              f"max_staleness: {state['lag']}.")
        self.requested, self.ready = state["requested"], dict(state["ready"])
        self.in_flight = {i: (v, r if isinstance(r, int) else SampleRequest(**r))
                          for i, (v, r) in state.get("recipes", {}).items()}


def _trainable(model) -> dict[str, torch.Tensor]:
    """The weights an optimizer step changes (with LoRA, only the adapters), copied for the worker."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


# ---- the worker process ------------------------------------------------------------------------------------------
class Answers:
    """The rollouts a worker answered, by index, or the failure that stopped it (`who` names it in the error); the
    trainer's thread waits on `lock` for them."""

    who = "rollout worker"

    def __init__(self):
        self.results: dict[int, tuple] = {}
        self.failure: str | None = None
        self.lock = threading.Condition()

    def result(self, index: int) -> tuple:
        with self.lock:
            while index not in self.results and self.failure is None:
                self.lock.wait()
            if index not in self.results:
                raise self.error(index)
            return self.results.pop(index)

    def error(self, index: int | None = None) -> RuntimeError:
        """The worker's failure as the trainer raises it (`index`: the rollout it waited for)."""
        return RuntimeError(f"{self.who}: {'a rollout' if index is None else f'rollout {index}'} failed:\n"
                            f"{self.failure}")


class _Worker(Answers):
    """The forked worker and the trainer's side of its pipe. Messages are pickled whole (tensors by value): the
    trainer's sends never wait on the worker (a thread there reads them into a queue), and a thread here reads the
    results, so neither side blocks the other on a full pipe."""

    def __init__(self, rollouts: Rollouts, policy, reference=None):
        ours, theirs = Pipe()
        pid = fork()
        if pid == 0:  # the worker: never returns into the trainer's code
            code = 0
            try:
                ours.close()
                _serve(theirs, rollouts, policy, reference)
            except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        super().__init__()
        self.pid, self.conn = pid, ours
        self.reader = threading.Thread(target=self._read, daemon=True, name="grpo-rollout-results")
        self.reader.start()

    def send(self, message: Weights | Generate) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                message = Failure(None, "the rollout worker exited without a reply")
            with self.lock:
                if isinstance(message, Failure):
                    self.failure = self.failure or message.traceback
                else:
                    self.results[message.index] = (message.sampled, message.logs, message.info)
                self.lock.notify_all()
            if isinstance(message, Failure):
                return

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # (its rollouts in flight are not needed: a checkpoint kept them)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.conn.close()


def _serve(conn: Connection, rollouts: Rollouts, policy, reference=None) -> None:
    """The worker's loop: weights are copied into its model; each request is generated and scored with the
    weights last copied (and its rows' reference log-probs taken, with `reference`), and answered with its Sampled
    fields, what reward functions logged and its times."""
    leave_stops_to_the_trainer()  # (it checkpoints, with this worker's rollouts in flight, and ends it with SIGKILL)
    torch.set_num_threads(1)  # its own core: the trainer's process keeps its threads
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                inbox.put(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError):
                inbox.put(Stop())
                return

    threading.Thread(target=read, daemon=True).start()
    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    version, index = None, None
    try:
        while True:
            t0 = time.perf_counter()
            message = inbox.get()
            idle = time.perf_counter() - t0
            if isinstance(message, Stop):
                return
            if isinstance(message, Weights):
                with torch.no_grad():
                    for name, value in message.tensors.items():
                        params[name].copy_(value)
                rollouts.engine_stale, version = True, message.version  # (an engine with its own copy loads them)
                continue
            index, wanted, request = message.index, message.version, message.request
            if wanted != version:  # (the order of the pipe makes this impossible; checked, not assumed)
                raise RuntimeError(f"rollout {index} names weights version {wanted}, the worker has {version}")
            if rollouts.trainer_state is not None:
                rollouts.trainer_state.global_step = version  # (what reward functions see: the weights' step)
            sampled, logs = rollouts.sample_request(request)
            info = {"version": version, "idle": idle, "ref_logp": None}
            if reference is not None:  # the update's first-pass micro-batches, as the trainer's process plans them
                t1 = time.perf_counter()
                ids, attention, cmask = rollout_tensors(sampled, rollouts.cfg.mask_truncated_completions,
                                                        rollouts.tokenizer.pad_token_id)
                batch = RolloutBatch(ids, attention, cmask, torch.zeros(len(sampled.total)), index=index,
                                     routes=rollout_routes(sampled, attention, cmask))  # (MoE: replayed with R3)
                info["ref_logp"] = reference(batch).cpu()
                logs["times"]["reference"] = time.perf_counter() - t1
            conn.send_bytes(pickle.dumps(Answer(index, vars(sampled), logs, info), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:
        conn.send_bytes(pickle.dumps(Failure(index, traceback.format_exc())))
        raise



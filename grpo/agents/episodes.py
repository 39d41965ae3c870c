"""An agent as the rollout: the user's `episode(client, row)` runs against the endpoint (grpo.agents.endpoint)
serving the policy, and the calls it makes are trained on.

    def episode(client: openai.OpenAI, row: dict) -> float | dict:     # or `async def`, given an AsyncOpenAI
        reply = client.chat.completions.create(model="policy", messages=row["prompt"], tools=TOOLS)
        ...
        return 1.0 if right else 0.0          # or {"reward": 1.0, "other": ...}: the others are logged

    trainer = GRPOTrainer(model=..., args=args, train_dataset=dataset, rollout_func=Episodes(episode))

Each step, every row of this process (each prompt G times) gets an episode, all run concurrently, each with its own
client whose `base_url` names the episode, so its calls are recorded token-exactly (grpo.agents.recording) and
seeded from the row's seed and the call's index. An episode's calls become its training row(s), its return value the
reward `episode` (weight 1, beside any `reward_funcs`). An episode that raises, overruns `timeout_s` or never calls
the model is counted and logged (`episodes/<fault>`) and trains nothing (reward None: advantage 0); the run goes on.
The episodes run in the trainer's process (`processes=0`), or in worker processes of their own, off the interpreter
lock the endpoint and the engine need (`processes=N`: grpo.agents.processes).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
from typing import Callable

from grpo.agents.endpoint import Endpoint
from grpo.agents.loop import Trajectories
from grpo.agents.processes import WORKER_DIED, EpisodeWorkers
from grpo.agents.recording import assemble
from grpo.agents.worker import FORKED_CUDA, used_cuda_in_fork
from grpo.config import ConfigError

logger = logging.getLogger(__name__)
FAULTS = ("raised", "timeout", "no_calls", "bad_return", WORKER_DIED)


class Episodes:
    """The rollout of an agent's `episode(client, row) -> float | dict` (see the module's docstring). `timeout_s`:
    each episode's deadline; `host`, `port`, `token`: where the endpoint listens (a token is needed off
    127.0.0.1); `window_s`: how long the endpoint waits to batch requests; `client_kwargs`: more arguments for the
    openai client; `processes`: 0 runs the episodes in the trainer's process, N >= 1 in N worker processes of their
    own (grpo.agents.processes), off the interpreter lock the engine and the endpoint need."""

    def __init__(self, episode: Callable, timeout_s: float = 300.0, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, window_s: float = 0.05, client_kwargs: dict | None = None,
                 processes: int = 0):
        if not callable(episode):
            raise ConfigError(f"Episodes: episode must be a function episode(client, row); got {episode!r}.")
        if not timeout_s > 0:
            raise ConfigError(f"Episodes: timeout_s must be > 0 seconds, got {timeout_s!r}.")
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ConfigError(f"Episodes: processes must be an integer >= 0 (0: in the trainer's process), got "
                              f"{processes!r}.")
        try:
            import openai  # noqa: F401 - (here, not in the first rollout: importing it takes seconds)
        except ImportError:
            raise ConfigError("Episodes: the episodes' clients need the openai package: pip install openai") from None
        self.episode, self.timeout_s = episode, float(timeout_s)
        self.is_async = inspect.iscoroutinefunction(episode)
        self.host, self.port, self.token, self.window_s = host, port, token, window_s
        self.client_kwargs = dict(client_kwargs or {})
        self.processes = processes
        self.__name__ = getattr(episode, "__name__", "episode")
        self.reads_rows = True  # the episode gets its row's columns (kept with remove_unused_columns)

    def reward_funcs(self) -> list[tuple[str, Callable]]:
        """The episode's return as a reward function (weight 1), which also logs the episodes' counts."""
        return [("episode", episode_reward)]

    def rollout(self, generator, tokenizer, params, model_name: str | None, autocast,
                max_completion_length: int) -> "EpisodeRollout":
        """The episodes' rollout over `generator` (the run's rollout engine), served under the run's `autocast`."""
        endpoint = Endpoint(generator, tokenizer, params, self.host, self.port, self.token, self.window_s,
                            str(model_name or "policy"), autocast)
        return EpisodeRollout(self, endpoint, max_completion_length)

    def __call__(self, prompts, trainer):  # (the rollout_func shape; the trainer takes `rollout` instead)
        raise ConfigError("Episodes: pass it as rollout_func to GRPOTrainer, which runs it through its endpoint.")


def episode_reward(prompts, completions, episode_reward, episode_stats, log_metric=None, **_) -> list:
    """The reward `episode`: each episode's return (None for an episode that failed), and the step's counts."""
    if log_metric is not None:
        for name, key in (("model_calls", "turns"), ("tool_calls", "calls"), ("drift", "drift"),
                          ("extra_rows", "extra_rows"), *((f, f) for f in FAULTS)):
            log_metric(f"episodes/{name}", float(sum(s.get(key, 0) for s in episode_stats)))
        logged = sorted({k for s in episode_stats for k in s.get("logged", {})})
        for key in logged:  # (an episode's own numbers, beside its reward: their mean)
            values = [s["logged"][key] for s in episode_stats if key in s.get("logged", {})]
            log_metric(f"episode/{key}", sum(values) / len(values))
    return list(episode_reward)


class EpisodeRollout:
    """One step's episodes on this process, over `endpoint`; `budget`: max_completion_length per chain of calls."""

    def __init__(self, episodes: Episodes, endpoint: Endpoint, budget: int):
        self.episodes, self.endpoint, self.budget = episodes, endpoint, budget
        self.endpoint.params = None  # (set each step from the run's sampling settings)
        self.workers = EpisodeWorkers(episodes, episodes.processes, run_episodes) if episodes.processes else None

    @property
    def generator(self):
        """The engine the endpoint serves from: a rollout worker's copy (max_staleness) serves from the worker's
        engine; a copy given a server's engine pinned to a step's weights (vllm_mode: server with a lag) serves
        from that, through an endpoint of its own."""
        return self.endpoint.engine

    @generator.setter
    def generator(self, engine) -> None:
        self.endpoint = self.endpoint.serving(engine)

    def generate(self, prompts: list, prompt_ids, columns: dict[str, list], params, seeds: list[int]) -> Trajectories:
        endpoint = self.endpoint
        endpoint.params = params
        keys = [endpoint.open_episode(seed, self.budget) for seed in seeds]
        rows = [{**{k: v[i] for k, v in columns.items()}, "prompt": p} for i, p in enumerate(prompts)]
        if self.workers is not None:
            self.workers.ready()  # (forked before the endpoint's threads start)
            endpoint.clocks = [self.workers.cpu_seconds]  # (their CPU is the episodes' building requests)
        with endpoint:  # (serving while the episodes run: no port open between rollouts)
            jobs = [(key, endpoint.episode_url(key), row) for key, row in zip(keys, rows)]
            endpoint.waiting = len(keys)  # (the batcher waits for as many requests; one fewer as each ends)
            try:
                if self.workers is not None:
                    outcomes = self.workers.run(jobs, endpoint.token, endpoint.episode_ended)
                else:
                    outcomes = _run_in_thread(run_episodes(self.episodes, jobs, endpoint.token,
                                                           lambda *_: endpoint.episode_ended()))
            finally:
                endpoint.waiting = 0
            records = [endpoint.close_episode(k) for k in keys]
        if any(fault == FORKED_CUDA for _, fault in outcomes):
            raise RuntimeError("Episodes: an episode used CUDA in its worker process, which was forked from a "
                               "trainer that had initialised CUDA (a fork cannot use it); an episode must not use "
                               "CUDA with processes >= 1: keep its work on the CPU, or set processes=0.")
        return self._trajectories(prompts, prompt_ids, records, outcomes)

    def _trajectories(self, prompts, prompt_ids, records, outcomes) -> Trajectories:
        ids, masks, logprobs, truncated, completions, stats, rewards, extra = [], [], [], [], [], [], [], []
        prompt_ids = list(prompt_ids)
        for i, (record, (value, fault)) in enumerate(zip(records, outcomes)):
            reward, logged = None, {}
            if fault is None:
                reward, logged, fault = _reward(value)
            if fault is None and not record.calls:
                reward, fault = None, "no_calls"
            if fault is not None and fault != "raised":
                logger.warning("episode %s: %s", record.key, fault)
            rows = assemble(record.calls)
            first = rows[0] if rows else None
            trained = fault is None
            ids.append(first.ids if first else [])
            masks.append(first.mask if first and trained else [0] * len(ids[-1]))
            logprobs.append(first.logprobs if first else [])
            truncated.append(first.truncated if first else False)
            if first is not None:
                prompt_ids[i] = first.prompt_ids
            if trained:
                extra += [(i, r.prompt_ids, r.ids, r.mask, r.logprobs) for r in rows[1:]]
            completions.append([c.reply for c in sorted(record.calls, key=lambda c: c.index) if c.reply])
            rewards.append(reward)
            stats.append({"turns": len(record.calls), "calls": sum(c.tool_calls for c in record.calls),
                          "drift": sum(c.drift for c in record.calls), "extra_rows": len(rows[1:]) if trained else 0,
                          **({fault: 1} if fault else {}), "logged": logged})
        return Trajectories(list(prompts), list(prompt_ids), ids, masks, truncated, logprobs, completions,
                            [{k: v for k, v in s.items() if k != "logged"} for s in stats],
                            {"episode_reward": rewards, "episode_stats": stats}, extra_rows=extra)


async def run_episodes(spec: Episodes, jobs: list[tuple[str, str, dict]], token: str | None,
                       ended: Callable[[str, object, str | None], None]) -> list[tuple[object, str | None]]:
    """Run the episodes of `jobs` (key, base_url, row) concurrently: (the return value, None) or (None, a fault)
    of each; `ended(key, value, fault)` as each ends. In the trainer's process or in a worker process."""
    import openai

    # One HTTP client for the step's episodes (an openai client making its own costs ~0.1 s of CPU: its connection
    # pool and TLS context), unless the user's client_kwargs give one. verify=False: the endpoint is plain HTTP,
    # and the certificate store a verifying client loads costs 0.13-0.17 s of CPU a step.
    shared = None if "http_client" in spec.client_kwargs else (
        openai.DefaultAsyncHttpxClient(verify=False) if spec.is_async else openai.DefaultHttpxClient(verify=False))
    try:
        return await asyncio.gather(*(_one(spec, key, url, row, token, shared, ended) for key, url, row in jobs))
    finally:
        if shared is not None:
            await shared.aclose() if spec.is_async else shared.close()


async def _one(spec: Episodes, key: str, url: str, row: dict, token: str | None, http_client,
               ended: Callable) -> tuple[object, str | None]:
    """(the episode's return, None) or (None, its fault)."""
    import openai

    kwargs = {"base_url": url, "api_key": token or "grpo", "max_retries": 0, "timeout": spec.timeout_s,
              **spec.client_kwargs}
    if http_client is not None:
        kwargs["http_client"] = http_client
    client = (openai.AsyncOpenAI if spec.is_async else openai.OpenAI)(**kwargs)
    value, fault = None, None
    try:
        if spec.is_async:
            value = await asyncio.wait_for(spec.episode(client, row), spec.timeout_s)
        else:
            value = await asyncio.wait_for(_in_thread(spec.episode, client, row), spec.timeout_s)
    except asyncio.TimeoutError:
        logger.warning("episode %s: over its deadline of %g s; abandoned, its calls refused from now on", key,
                       spec.timeout_s)
        fault = "timeout"
    except Exception as err:  # noqa: BLE001 - the agent's own errors are counted, the run goes on
        logger.warning("episode %s raised %s: %s", key, type(err).__name__, err)
        fault = FORKED_CUDA if used_cuda_in_fork(err) else "raised"
    finally:
        if http_client is None:  # (its own client: closed before its event loop ends; a shared one in run_episodes)
            await client.close() if spec.is_async else client.close()
    ended(key, value, fault)
    return value, fault


def one_row_each(procs, extra_rows) -> None:
    """On several processes every episode must be one row (its calls each extend the last): extra rows would give
    the processes different numbers of rows, then of micro-batches, and their collectives would not meet.
    Collective: every process calls it for the same rollout; all raise together, naming the counts."""
    import torch

    counts = procs.gather(torch.tensor([len(extra_rows or [])], dtype=torch.long)).tolist()
    if any(counts):
        raise RuntimeError(f"Episodes on {procs.world} processes: episodes made calls that do not extend their "
                           f"episode's last call (extra rows per process: {counts}); on several processes each "
                           "episode must be one chain of calls (send the whole history each call). Run one "
                           "process for such an agent.")


def _reward(value) -> tuple[float | None, dict, str | None]:
    """(reward, logged values, fault) of an episode's return: a number, or a dict with "reward" and more numbers."""
    logged = {}
    if isinstance(value, dict):
        logged = {k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, (int, float))}
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        logger.warning("episode: returned %r; an episode returns a finite number or a dict with a \"reward\" number",
                       value)
        return None, logged, "bad_return"
    return float(value), logged, None


def _in_thread(func, *args):
    """`func(*args)` on a daemon thread of its own, as an awaitable: one past its deadline is abandoned (a thread
    cannot be stopped) without holding up the step or the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target():
        try:
            value, error = func(*args), None
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, err
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is gone: the episode was abandoned
            pass

    threading.Thread(target=target, name="grpo-episode", daemon=True).start()
    return future


def _run_in_thread(coroutine):
    """Run `coroutine` on a new event loop in a thread of its own (the caller may already be in a loop)."""
    result: dict = {}

    def target():
        try:
            result["value"] = asyncio.run(coroutine)
        except BaseException as err:  # noqa: BLE001 - raised in the caller
            result["error"] = err

    thread = threading.Thread(target=target, name="grpo-episodes")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]

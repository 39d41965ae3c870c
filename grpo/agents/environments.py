"""`environment_factory`, in TRL 1.16's shape: environments whose public methods are the model's tools.

    class Guess:
        def reset(self, **row) -> str | None: ...      # called with the dataset row before each rollout
        def guess(self, n: int) -> str: ...            # a tool (type hints and an Args: docstring, as any tool)
        def get_reward(self) -> float: ...             # optional: scores the finished rollout

    GRPOTrainer(..., environment_factory=Guess)                      # one environment for every row
    GRPOTrainer(..., environment_factory={"guess": Guess, "maze": Maze})   # by each row's `environment` column

Every public method but `reset` and `get_reward` is a tool (listed on the class, so properties are not evaluated).
`reset(**row)` gets the row's columns (and `prompt`; not `environment` with a dict of factories) and returns None
or text that is appended to the prompt's last user message. Each rollout (each of the G completions of a prompt)
has an instance of its own; instances are kept in a pool and reused, reset, on later steps: the pool grows only
when a step needs more instances of an environment at once than it has. A class with `get_reward` is an extra
reward source, named after the class, weight 1, `None` for rows of other environments. Reward functions also
receive the instances as the `environments` keyword, one per completion, as in TRL.

The methods run in the trainer's process, on their instance (the state is the environment's; `get_reward` reads
it), each on a thread with the tool deadline. A call that passes it is abandoned (Python cannot stop a thread): its
instance is not reused, since its state may be half-changed, and the pool makes a new one. Arguments come from the
model's JSON, checked against the method's schema; nothing the model writes is evaluated.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable

from grpo.agents.tools import Tool, ToolError, make_tool

COLUMN = "environment"  # the row's environment, with a dict of factories


class Environments:
    """The factories, the tools of each environment, and the pool of instances."""

    def __init__(self, factory: Callable | dict[str, Callable]):
        self.multi = isinstance(factory, dict)
        self.factories: dict[Any, Callable] = dict(factory) if self.multi else {None: factory}
        if not self.factories or not all(callable(f) for f in self.factories.values()):
            raise ToolError("environment_factory: must be a callable that returns an environment, or a non-empty "
                            "dict of them by environment name.")
        self.pool: dict[Any, list] = {}
        self.methods: dict[Any, list[str]] = {}
        self.schemas: dict[Any, list[dict]] = {}
        self.reward_classes: list[type] = []
        for name, make in self.factories.items():  # one instance of each, probed now and kept for the pool
            instance = make()
            where = f"environment_factory{'' if name is None else f'[{name!r}]'}"
            if not callable(getattr(instance, "reset", None)):
                raise ToolError(f"{where}: its environments have no reset(**row) method; define one (it may "
                                "return None, or text to append to the prompt).")
            self.methods[name] = public_methods(type(instance))
            self.schemas[name] = [make_tool(getattr(instance, m), in_process=True).schema for m in self.methods[name]]
            self.pool[name] = [instance]
            has_reward = callable(getattr(instance, "get_reward", None))
            if has_reward and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def names(self, columns: dict[str, list], n: int, known: bool = True) -> list:
        """The environment name of each of `n` rows (None for all with a single factory). `known`: a row naming
        no environment of the factory is TRL's ValueError, raised as TRL raises it, when a rollout draws the row
        (rendering the data's prompts when the trainer is made passes known=False: such a row gets no tools)."""
        if not self.multi:
            return [None] * n
        if COLUMN not in columns:
            raise ToolError(f"environment_factory: a dict of environments needs an {COLUMN!r} column in the dataset "
                            f"naming each row's environment (one of {sorted(self.factories)}).")
        names = list(columns[COLUMN])
        for name in dict.fromkeys(names) if known else ():
            if name not in self.factories:  # (TRL's words)
                raise ToolError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                                f"`environment_factory`. Expected one of: {list(self.factories)}.")
        return names

    def take(self, names: list) -> list:
        """One instance per row, from the pool (made when the pool has too few), in the rows' order."""
        handed: dict[Any, int] = {}
        out = []
        for name in names:
            index = handed.get(name, 0)
            if index == len(self.pool[name]):
                self.pool[name].append(self.factories[name]())
            handed[name] = index + 1
            out.append(self.pool[name][index])
        return out

    def retire(self, instance) -> None:
        """Replace `instance` (a call on it overran its deadline) by a new one in the pool."""
        for name, instances in self.pool.items():
            for i, other in enumerate(instances):
                if other is instance:
                    instances[i] = self.factories[name]()
                    return

    def tools_of(self, name, instance) -> list[Tool]:
        """The tools of one instance of environment `name`: its methods, bound to it."""
        return [Tool(m, getattr(instance, m), schema, in_process=True)
                for m, schema in zip(self.methods[name], self.schemas[name])]

    def reward_funcs(self) -> list[tuple[str, Callable]]:
        """(class name, reward function) for each environment class with `get_reward`."""
        return [(cls.__name__, _reward_of(cls)) for cls in self.reward_classes]


def public_methods(cls: type) -> list[str]:
    """The tool methods of an environment class: public functions other than reset and get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def _reward_of(cls: type) -> Callable:
    def get_reward(environments, **kwargs) -> list[float | None]:
        return [_result(e.get_reward()) if type(e) is cls else None for e in environments]

    get_reward.__name__ = cls.__name__
    return get_reward


def _result(value):
    return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


async def _awaited(awaitable):
    return await awaitable


def call_with_deadline(function: Callable, arguments: dict, timeout_s: float) -> tuple[Any, BaseException | None,
                                                                                           bool]:
    """(value, error, timed_out) of function(**arguments) on a daemon thread joined for at most `timeout_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _result(function(**arguments))
        except BaseException as err:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="grpo-environment")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, None, True
    return box.get("value"), box.get("error"), False

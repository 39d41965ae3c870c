"""The shape shared by parameterized built-in rewards: settings in a frozen dataclass, the reward in `__call__`.

The module-level names (`grpo.rewards.countdown`, ...) are default instances, so they are reward functions as they
stand; `countdown.configure(exact_use=True)` (or the class, `Countdown(exact_use=True)`) makes a configured one.
A YAML config reaches the same constructor through `grpo.rewards.resolve_reward({"name": ..., **settings})`.
"""

import dataclasses
import types
import typing
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class ConfigurableReward:
    """Base of the parameterized built-ins. Subclasses are frozen dataclasses whose fields are the settings."""

    name: ClassVar[str] = "reward"
    # Dataset columns read by the reward, each entry a tuple of accepted names (any one suffices, first preferred).
    # `RewardRunner.check_columns` reads this instead of the signature, which is `**columns` for these classes.
    column_requirements: ClassVar[tuple[tuple[str, ...], ...]] = ()

    def __post_init__(self):
        """Check each setting against its annotation, so that a YAML typo fails at load time with a clear message."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if typing.get_origin(field.type) is tuple and typing.get_args(field.type)[0] is str:
                if not isinstance(value, (tuple, list)) or not all(isinstance(item, str) for item in value):
                    raise ValueError(f"{self.name}: setting {field.name} must be a list of names, got {value!r}")
                object.__setattr__(self, field.name, tuple(value))  # YAML gives a list; keep instances hashable
            elif not _matches(value, field.type):
                raise ValueError(
                    f"{self.name}: setting {field.name} must be {_type_name(field.type)}, got {value!r} "
                    f"({type(value).__name__})"
                )

    @property
    def __name__(self) -> str:
        # TRL and our runner name a reward function by `__name__`; instances need one too.
        return self.name

    @classmethod
    def setting_names(cls) -> list[str]:
        return [field.name for field in dataclasses.fields(cls)]

    def settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.setting_names()}

    def configure(self, **changes: Any) -> "ConfigurableReward":
        """A copy with some settings changed; an unknown setting is a `ValueError` listing the known ones."""
        unknown = sorted(set(changes) - set(self.setting_names()))
        if unknown:
            raise ValueError(
                f"reward '{self.name}' has no setting {', '.join(map(repr, unknown))}; "
                f"its settings are: {', '.join(self.setting_names()) or '(none)'}"
            )
        return dataclasses.replace(self, **changes)


def _matches(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`
        return any(_matches(value, member) for member in typing.get_args(kind))
    if kind is float:  # an int is a fine float; a bool is not a number here
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    # Other generics (list[...], Callable[...]) are left to the subclass.
    return isinstance(value, kind) if isinstance(kind, type) else True


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)

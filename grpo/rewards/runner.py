"""Call reward functions on a batch and combine them: TRL's protocol, with every failure named.

Protocol (TRL `GRPOTrainer._calculate_rewards`): each function is called with keyword arguments `prompts`,
`completions`, `completion_ids` and one keyword per dataset column, and returns one `float | None` per completion;
`None` means "does not apply to this sample". The total is TRL's nansum: sum over functions of weight * reward,
skipping None (reliability.md 3.1, features.md section 3).

Where TRL crashes or silently spoils a step (reliability.md 3.1, measured), this runner:
- raises `RewardError` naming the function for a wrong-length or non-numeric return;
- a row every function returned None for: `on_all_none="warn"` (TRL's) logs a warning naming the row and gives it
  a NaN total, which the advantages leave out of the group statistics and give advantage 0; `"raise"` raises
  `RewardError` naming the row;
- for a function that raises: `on_error="raise"` re-runs it row by row to name the failing row, then raises;
  `on_error="zero"` scores the failing rows 0.0 and counts them;
- for NaN/inf (TRL: an inf zeroes the whole group's advantages without a warning): `on_nonfinite="raise"` raises
  naming function and row; `on_nonfinite="none"` makes the value None and counts it.
A counted failure is logged once per function and kind (the first one, naming the row); the rest are counted
(`reward/errors/<name>`, the health alarm reward_errors, and `failure_summary()` at the run's end), so a function
that fails on every row prints one line, not one per row. The config's keys are reward_on_error and
reward_on_nonfinite (the messages name those).
`async def` reward functions run concurrently on an event loop, as TRL gathers them.

With `timeout_s` set (TRL has no timeout: a hanging function blocks its run forever, reliability.md 3.4), each call
has a deadline. A sync function runs in the calling thread, as TRL runs it, so functions that need the main thread
work (math-verify's `parse` arms `signal.alarm`, which Python allows only there: open-r1's rewards call it). On the
main thread a watchdog thread sends it a signal of its own (a real-time signal, never SIGALRM, which math-verify
re-arms and cancels) when the deadline passes, and the handler raises in the function; a function stuck in C code
that never returns to Python cannot be interrupted this way (work that must be killable belongs in a process, as
`math_accuracy` and `code` do). Off the main thread (a trainer run from a thread), signals cannot be used: the
function runs on a daemon thread that is abandoned if it overruns. An async function is cancelled. An overrun is a
`RewardError` naming the function, or with `on_error="zero"` scores the whole batch 0 for that function and is
counted in `timeouts` (it is not re-run row by row, which would hang once per row). A function that raises
`RewardUnavailable` (a reward's server down or out of protocol: grpo.rewards.judge, grpo.rewards.remote) is treated
alike: a `RewardError`, or with `on_error="zero"` the batch scored 0 and counted, not re-run row by row.

Besides the columns, every function may take TRL's `trainer_state` (a `transformers.TrainerState`), `log_extra(column,
values)` (a column of the sample completions) and `log_metric(name, value)` (a metric averaged over the step), given
as `extras`.
"""

import dataclasses
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .calls import RewardTimeout, call_all, signature_of
from .text import completion_text

logger = logging.getLogger(__name__)

RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# Columns TRL does not pass as keywords: the prompt arrives as `prompts`, and the rest would clash.
_NOT_PASSED = {"prompt", "completion", *RESERVED}
EXTRAS = ("trainer_state", "log_extra", "log_metric")


class RewardError(ValueError):
    """A reward function broke the protocol or failed; the message names the function and, when known, the row."""


class RewardUnavailable(RuntimeError):
    """A reward's server failed the whole batch (down, too slow, a reply out of protocol): not the fault of a row,
    so the runner does not re-run it row by row (which would wait on the server once per row)."""


@dataclass
class RewardOutput:
    """Rewards of one batch of B*G completions.

    total: (B*G,) weighted sum over the functions that applied (None skipped).
    per_func: function name -> (B*G,) rewards as returned (non-finite ones as None with on_nonfinite="none").
    errors: function name -> rows that raised (on_error="zero") or were non-finite (on_nonfinite="none"),
        and every row of a timed-out call.
    timeouts: function name -> calls that overran timeout_s (on_error="zero").
    """

    total: list[float]
    per_func: dict[str, list[float | None]]
    errors: dict[str, int]
    timeouts: dict[str, int] = dataclasses.field(default_factory=dict)


def column_requirements(func: Callable) -> list[tuple[str, ...]]:
    """The dataset columns a reward function needs; each entry lists accepted names (any one suffices).

    Built-ins declare `column_requirements`; for any other function, every parameter without a default that is
    not `prompts` / `completions` / `completion_ids` is a required column.
    """
    declared = getattr(func, "column_requirements", None)
    if declared is not None:
        return [tuple(names) for names in declared]
    signature = signature_of(func)
    if signature is None:
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        (p.name,)
        for p in signature.parameters.values()
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in RESERVED
    ]


class RewardRunner:
    """Weighted combination of named reward functions; see the module docstring for the error policy."""

    def __init__(
        self,
        funcs: list[tuple[str, Callable]],
        weights: list[float] | None = None,
        on_error: str = "raise",
        on_nonfinite: str = "raise",
        timeout_s: float | None = None,
        on_all_none: str = "raise",
        specs: list | None = None,
    ):
        if not funcs:
            raise ValueError("RewardRunner needs at least one reward function")
        self.names = [name for name, _ in funcs]
        self.funcs = [func for _, func in funcs]
        duplicates = sorted({name for name in self.names if self.names.count(name) > 1})
        if duplicates:
            raise ValueError(f"reward function names must be unique, repeated: {', '.join(duplicates)}")
        for name, func in funcs:
            if not callable(func):
                raise ValueError(f"reward function '{name}' is not callable ({type(func).__name__})")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions ({self.names})")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite numbers, got {weights}")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if on_nonfinite not in ("raise", "none"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'none', got {on_nonfinite!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        if on_all_none not in ("raise", "warn"):
            raise ValueError(f"on_all_none must be 'raise' or 'warn', got {on_all_none!r}")
        self.on_all_none = on_all_none
        self.weights = weights
        self.specs = list(self.names) if specs is None else list(specs)  # as given (config.yaml records them;
        # soft_overlong, which the config adds, is not among them)
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.on_nonfinite = on_nonfinite
        self.rows = {name: 0 for name in self.names}  # rows scored this run, and those that failed
        self.failed = {name: 0 for name in self.names}
        self.first_failure: dict[tuple[str, str], str] = {}  # (function, kind) -> the one line logged for it

    def check_columns(self, columns: Iterable[str]) -> None:
        """Raise `RewardError` before training when a function needs a column the dataset lacks."""
        available = set(columns)
        listing = ", ".join(sorted(available)) or "none"
        problems = []
        for name, func in zip(self.names, self.funcs):
            for accepted in column_requirements(func):
                if not available.intersection(accepted):
                    wanted = " or ".join(f"'{column}'" for column in accepted)
                    hint = getattr(func, "column_hint", "")  # (what else the reward can read, if anything)
                    problems.append(f"reward function '{name}' needs column {wanted}, which the dataset lacks "
                                    f"(columns: {listing})" + (f"; {hint}" if hint else ""))
        if problems:
            raise RewardError("\n".join(problems))

    def __call__(
        self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
        extras: dict[str, Any] | None = None,
    ) -> RewardOutput:
        """Score B*G completions. prompts, completion_ids and each column hold one entry per completion; `extras`
        (trainer_state, log_extra, log_metric) are passed to every function that takes them."""
        n = len(completions)
        _check_lengths(n, {"prompts": prompts, "completion_ids": completion_ids, **columns})
        batch = {
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": list(completion_ids),
            **{key: list(value) for key, value in columns.items() if key not in _NOT_PASSED},
            **{key: value for key, value in (extras or {}).items() if key in EXTRAS},
        }
        errors = {name: 0 for name in self.names}
        timeouts = {name: 0 for name in self.names}
        per_func = {}
        results = call_all(self.funcs, batch, self.timeout_s)
        for name, func, result in zip(self.names, self.funcs, results):
            if isinstance(result, RewardTimeout):
                values = self._timed_out(name, n, errors, timeouts)
            elif isinstance(result, RewardUnavailable):
                values = self._unavailable(name, n, result, errors)
            elif isinstance(result, Exception):
                values = self._row_by_row(name, func, batch, result, errors)
            else:
                values = _validate(name, result, n)
            per_func[name] = self._finite(name, values, errors)
            self.rows[name] += n
            self.failed[name] += errors[name]
        return RewardOutput(self._combine(per_func, completions), per_func, errors, timeouts)

    def _timed_out(self, name: str, n: int, errors: dict, timeouts: dict) -> list[float | None]:
        if self.on_error == "raise":
            raise RewardError(
                f"reward function '{name}' did not return within {self.timeout_s} s on a batch of {n} completions. "
                "Make it faster, raise reward_timeout, or set reward_on_error: zero to score such batches 0 and "
                "count them."
            )
        self._once(name, "timeout", f"reward function '{name}' timed out after {self.timeout_s} s; its {n} rewards "
                   "scored 0")
        timeouts[name] += 1
        errors[name] += n  # (every row of the call failed: as n rows that raised, so reward_errors alarms alike)
        return [0.0] * n

    def _unavailable(self, name: str, n: int, error: RewardUnavailable, errors: dict) -> list[float | None]:
        if self.on_error == "raise":
            raise RewardError(f"reward function '{name}' failed on a batch of {n} completions: {error}. Or set "
                              "reward_on_error: zero to score such batches 0 and count them.") from error
        self._once(name, "unavailable", f"reward function '{name}' failed on the batch ({error}); its {n} rewards "
                   "scored 0")
        errors[name] += n
        return [0.0] * n

    def _row_by_row(self, name: str, func: Callable, batch: dict, error: Exception, errors: dict) -> list:
        """Re-run a function that raised on the batch one row at a time, to name (or zero) the failing rows."""
        values: list[float | None] = []
        failed = 0
        for row in range(len(batch["completions"])):
            single = {key: value if key in EXTRAS else value[row : row + 1] for key, value in batch.items()}
            result = call_all([func], single, self.timeout_s)[0]
            if not isinstance(result, Exception):
                values.extend(_validate(name, result, 1))
                continue
            failed += 1
            where = f"row {row} (completion {_preview(batch['completions'][row])})"
            if self.on_error == "raise":
                raise RewardError(
                    f"reward function '{name}' raised {type(result).__name__}: {result} on {where}. Fix the "
                    "function, or set reward_on_error: zero to score such rows 0 and count them."
                ) from result
            self._once(name, "raised", f"reward function '{name}' raised {result!r} on {where}; scored 0")
            values.append(0.0)
        if failed == 0 and self.on_error == "raise":
            raise RewardError(
                f"reward function '{name}' raised {type(error).__name__}: {error} on the batch of "
                f"{len(values)} completions, but on no single row when re-run one at a time"
            ) from error
        if failed == 0:
            # A transient failure (a dropped connection, ...): the row-by-row rewards stand; the failure is counted.
            self._once(name, "batch", f"reward function '{name}' raised {error!r} on the batch; row-by-row rewards "
                       "used")
        errors[name] += max(failed, 1)
        return values

    def _finite(self, name: str, values: list[float | None], errors: dict) -> list[float | None]:
        for row, value in enumerate(values):
            if value is None or math.isfinite(value):
                continue
            if self.on_nonfinite == "raise":
                raise RewardError(
                    f"reward function '{name}' returned {value} for row {row}; rewards must be finite. "
                    "Fix the function, or set reward_on_nonfinite: none to skip such values (they are counted)."
                )
            self._once(name, "nonfinite", f"reward function '{name}' returned {value} for row {row}; treated as None")
            values[row] = None
            errors[name] += 1
        return values

    def _once(self, name: str, kind: str, message: str) -> None:
        """Log the first failure of this kind of function `name`; later ones are only counted."""
        if (name, kind) not in self.first_failure:
            self.first_failure[name, kind] = message
            logger.warning("%s (further failures of it are counted in reward/errors/%s, not printed)", message, name)

    def failure_summary(self, fraction: float = 0.1) -> list[str]:
        """One line per function that failed on more than `fraction` of its rows this run (with its first failure)."""
        lines = []
        for name in self.names:
            if self.rows[name] and self.failed[name] > fraction * self.rows[name]:
                first = next((m for (n, _), m in self.first_failure.items() if n == name), "")
                lines.append(f"reward function '{name}' failed on {self.failed[name]} of {self.rows[name]} rows "
                             f"({self.failed[name] / self.rows[name]:.0%}) this run; the first: {first}")
        return lines

    def _combine(self, per_func: dict[str, list[float | None]], completions: list) -> list[float]:
        total = []
        for row in range(len(completions)):
            terms = [
                w * per_func[name][row] for name, w in zip(self.names, self.weights) if per_func[name][row] is not None
            ]
            if not terms:
                message = (f"every reward function ({', '.join(self.names)}) returned None for row {row} "
                           f"(completion {_preview(completions[row])})")
                if self.on_all_none == "raise":
                    raise RewardError(f"{message}; at least one must apply to each sample (or set "
                                      "reward_on_all_none: warn to give such rows advantage 0, as TRL does)")
                logger.warning("All reward functions returned None for the following kwargs: %s; it gets advantage 0",
                               message)  # (TRL's opening words)
                total.append(math.nan)
                continue
            total.append(sum(terms))
        return total


def _check_lengths(n: int, lists: dict[str, Any]) -> None:
    for key, value in lists.items():
        if len(value) != n:
            raise RewardError(f"'{key}' has {len(value)} entries for {n} completions; one per completion is needed")


def _validate(name: str, result: Any, n: int) -> list[float | None]:
    """One float or None per completion, or `RewardError` naming the function (and row)."""
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__") or not hasattr(result, "__iter__"):
        raise RewardError(
            f"reward function '{name}' returned {type(result).__name__}; it must return a list with one float or "
            f"None per completion ({n})"
        )
    values = list(result)
    if len(values) != n:
        raise RewardError(
            f"reward function '{name}' returned {len(values)} rewards for {n} completions; it must return one "
            "float or None per completion"
        )
    return [_number(name, row, value) for row, value in enumerate(values)]


def _number(name: str, row: int, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise RewardError(
            f"reward function '{name}' returned {value!r} ({type(value).__name__}) for row {row}; "
            "a reward must be a number or None"
        )
    try:
        return float(value)
    except OverflowError:  # a Python int such as 10**400: a non-finite reward, handled by on_nonfinite
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError) as error:
        raise RewardError(
            f"reward function '{name}' returned {value!r} for row {row}, which is not a single number: {error}"
        ) from None


def _preview(completion: Any) -> str:
    try:
        text = completion_text(completion)
    except TypeError:
        text = str(completion)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))

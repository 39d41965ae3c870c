"""Reward functions the tests import by `module:function` path, as a user's own file would be."""


def count_a(completions, **kwargs):
    """The share of 'a' characters in each completion: learnable from a random model in a few steps."""
    return [c.count("a") / max(1, len(c)) for c in completions]


def called_a_tool(completions, **kwargs):
    """1 for a multi-turn completion in which the model called a tool (a tool message follows its turn), else 0."""
    return [float(isinstance(c, list) and any(m.get("role") == "tool" for m in c)) for c in completions]


def paced_count_a(completions, **kwargs):
    """count_a, taking 1 s: a run of the signal matrix lasts at least a rollout past any step it is signalled after
    (quiet, a tiny model's 6 steps took a fraction of a second, and the signals landed after the run's end)."""
    import time

    time.sleep(1.0)
    return count_a(completions, **kwargs)


def slow_count_a(completions, **kwargs):
    """count_a, taking 2.5 s: a rollout long enough for two Ctrl-C's a second apart to land inside it."""
    import time

    time.sleep(2.5)
    return count_a(completions, **kwargs)

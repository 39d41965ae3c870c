"""Reward functions the tests import by `module:function` path, as a user's own file would be."""


def count_a(completions, **kwargs):
    """The share of 'a' characters in each completion: learnable from a random model in a few steps."""
    return [c.count("a") / max(1, len(c)) for c in completions]


def slow_count_a(completions, **kwargs):
    """count_a, taking 2.5 s: a rollout long enough for two Ctrl-C's a second apart to land inside it."""
    import time

    time.sleep(2.5)
    return count_a(completions, **kwargs)

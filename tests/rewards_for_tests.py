"""Reward functions the tests import by `module:function` path, as a user's own file would be."""


def count_a(completions, **kwargs):
    """The share of 'a' characters in each completion: learnable from a random model in a few steps."""
    return [c.count("a") / max(1, len(c)) for c in completions]

"""Side-by-side benchmark of `grpo` and TRL's `GRPOTrainer` on identical work (see bench/README.md).

Run it as `python bench/run.py --workload W1|W2|W3|mini`. Nothing under `grpo/` imports this package, and TRL is
imported only by `bench/side_trl.py`, in its own subprocess.
"""

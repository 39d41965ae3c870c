"""A run's life: its directory and lock, the loop's state (`loop_state`), stop signals, when it logs / evaluates / saves (`control`), engine faults, exit codes and errors, the hub upload."""

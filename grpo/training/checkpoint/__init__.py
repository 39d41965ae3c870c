"""Checkpoints: atomic files (`files`), the trainer's state in them (`state`), sharded weights (`sharded`)."""

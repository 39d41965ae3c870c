"""Rows held in memory: the table the trainer reads a built-in task or a list of rows from when `datasets` is absent.

`datasets` is needed to read data files and the hub (`dataset_name`) and for streaming; a built-in task, or rows
given as a list of dicts or a dict of columns, train without it (an image that has torch and transformers but not
`datasets`, as some GPU images are). `Rows` offers the part of `datasets.Dataset` the trainer reads: `column_names`,
`len`, `rows[i]` (a dict), `rows[:]` (every column as a list), `rows["column"]`, iteration.
"""

from __future__ import annotations

from typing import Any, Iterator


class Rows:
    """Columns of equal length, as a table of rows."""

    def __init__(self, columns: dict[str, list[Any]]):
        lengths = {name: len(values) for name, values in columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Rows: columns have different lengths {lengths}; give every column one value per row.")
        self._columns = {name: list(values) for name, values in columns.items()}
        self._len = next(iter(lengths.values()), 0)

    @classmethod
    def from_list(cls, rows: list[dict[str, Any]]) -> "Rows":
        """Rows from a list of dicts; a key missing from a row reads as None there (as `Dataset.from_list` does)."""
        names = list(dict.fromkeys(name for row in rows for name in row))
        return cls({name: [row.get(name) for row in rows] for name in names})

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key):
        if isinstance(key, str):
            return list(self._columns[key])
        return {name: values[key] for name, values in self._columns.items()}  # (a row's dict, or a slice's columns)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(self._len))


def as_table(data):
    """`data` as a table the trainer reads: a list of dicts or a dict of columns becomes `Rows`; anything else (a
    `datasets.Dataset` or IterableDataset) is returned as it is. A dict none of whose values is a list is a dict of
    named datasets (TRL's several eval sets): each is made a table."""
    if isinstance(data, dict) and data and not any(isinstance(v, (list, tuple)) for v in data.values()):
        return {name: as_table(part) for name, part in data.items()}
    if isinstance(data, dict):
        return Rows(data)
    if isinstance(data, (list, tuple)):
        if not all(isinstance(row, dict) for row in data):
            raise ValueError("train_dataset: a list of rows must hold dicts (column name -> value).")
        return Rows.from_list(list(data))
    return data


def make_table(rows: list[dict[str, Any]]):
    """A `datasets.Dataset` of `rows` where `datasets` is installed, else `Rows`."""
    try:
        import datasets
    except ImportError:
        return Rows.from_list(rows)
    return datasets.Dataset.from_list(rows)


def has_datasets() -> bool:
    """Whether `datasets` imports here."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True

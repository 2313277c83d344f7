"""Reading verl-format parquet files with pyarrow.

verl's schema, one row per prompt:

    prompt          list of chat messages {"role": str, "content": str} (the column named by data.prompt_key)
    data_source     str: which dataset the row comes from (reward functions and val/score/<data_source> use it)
    reward_model    struct with ground_truth (and, in verl, a style such as "rule" that dppo does not need)
    extra_info      optional struct, passed to the reward function as it is

Other columns are not read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dppo._text import one_line
from dppo.data.errors import DataColumnError, DataFileError, DataRowError


@dataclass
class ParquetRows:
    """The rows of one or more files, column by column, with where each row came from."""

    messages: list[list[dict]] = field(default_factory=list)
    data_source: list[str] = field(default_factory=list)
    ground_truth: list[object] = field(default_factory=list)
    extra_info: list[object] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    file_rows: list[int] = field(default_factory=list)  # rows of each file, in order

    def __len__(self) -> int:
        return len(self.messages)

    def where(self, i: int) -> str:
        """'row 17 of 'data/train.parquet'' for row i (counted from 0 within its file)."""
        offset = 0
        for path, rows in zip(self.files, self.file_rows):
            if i < offset + rows:
                return f"row {i - offset} of {path!r}"
            offset += rows
        raise IndexError(f"row {i} of {len(self)}")


def read_parquet_files(files: str | list[str], prompt_key: str = "prompt") -> ParquetRows:
    """Every row of files (one path or a list), in order; DataFileError, DataColumnError or DataRowError
    naming the file, the column and the row of the first problem."""
    rows = ParquetRows()
    for path in [files] if isinstance(files, str) else list(files):
        _read_one(str(path), prompt_key, rows)
    return rows


def _read_one(path: str, prompt_key: str, rows: ParquetRows) -> None:
    import pyarrow as pa  # heavy; only a run on parquet data reads one (the config imports this package)
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise DataFileError(f"data file {path!r} does not exist")
    with open(path, "rb") as f:
        try:  # the footer, and every row group's metadata in it (not the data)
            parquet = pq.ParquetFile(f)
            schema, metadata = parquet.schema_arrow, parquet.metadata
            group_rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        except (pa.ArrowException, OSError) as err:
            raise DataFileError(f"data file {path!r} is not a readable parquet file ({one_line(err, None)})") from None
        for column, why in ((prompt_key, " (data.prompt_key)"), ("data_source", ""), ("reward_model", "")):
            if column not in schema.names:
                raise DataColumnError(
                    f"data file {path!r} has no column {column!r}{why}; its columns: {', '.join(schema.names)}"
                )
        reward_type = schema.field("reward_model").type
        if not pa.types.is_struct(reward_type) or reward_type.get_field_index("ground_truth") < 0:
            raise DataColumnError(
                f"data file {path!r}: column 'reward_model' has no field 'ground_truth' (its type: {reward_type})"
            )
        columns = [prompt_key, "data_source", "reward_model", *(["extra_info"] if "extra_info" in schema.names else [])]
        table = pa.concat_tables(
            [_read_row_group(parquet, path, i, group_rows, columns) for i in range(len(group_rows))]
            or [schema.empty_table().select(columns)]
        )
    if table.num_rows == 0:
        raise DataRowError(f"data file {path!r} has no rows")
    messages = table.column(prompt_key).to_pylist()
    data_source = table.column("data_source").to_pylist()
    ground_truth = [r["ground_truth"] if r is not None else None for r in table.column("reward_model").to_pylist()]
    extra_info = (
        table.column("extra_info").to_pylist() if "extra_info" in table.column_names else [None] * len(messages)
    )
    for i, (msgs, source, truth) in enumerate(zip(messages, data_source, ground_truth)):
        _check_row(path, i, prompt_key, msgs, source, truth)
    rows.messages.extend(messages)
    rows.data_source.extend(data_source)
    rows.ground_truth.extend(ground_truth)
    rows.extra_info.extend(extra_info)
    rows.file_rows.append(len(messages))
    rows.files.append(path)


def _read_row_group(parquet, path: str, index: int, group_rows: list[int], columns: list[str]):
    """Row group index of parquet as a table; DataFileError naming it and its rows if its pages cannot be read."""
    import pyarrow as pa

    try:
        return parquet.read_row_group(index, columns=columns)
    except (pa.ArrowException, OSError) as err:
        first = sum(group_rows[:index])
        raise DataFileError(
            f"data file {path!r}: row group {index} of {len(group_rows)} (rows {first} to "
            f"{first + group_rows[index] - 1}) cannot be read ({one_line(err, None)}); the file is "
            "damaged: write it again"
        ) from None


def _check_row(path: str, i: int, prompt_key: str, messages, data_source, ground_truth) -> None:
    where = f"row {i} of {path!r}"
    if not isinstance(messages, list) or not messages:
        raise DataRowError(
            f"{where}: column {prompt_key!r} holds {type(messages).__name__} {str(messages)[:60]!r}; "
            "expected a non-empty list of chat messages {role, content}"
        )
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataRowError(
                f"{where}: column {prompt_key!r} holds the message {str(message)[:60]!r}; "
                "expected {'role': str, 'content': str}"
            )
    if not isinstance(data_source, str):
        raise DataRowError(f"{where}: data_source is {data_source!r}; expected a string")
    if ground_truth is None:
        raise DataRowError(f"{where}: reward_model.ground_truth is null")

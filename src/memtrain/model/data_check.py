"""Look at each data file before any worker reads it: is it what its name says (text, JSON lines with
the text column, parquet with the text column), and is `data.seq_len` trainable at all.

Run by the preflight's `resolve_run`, so `make train`'s preflight and every worker give the same line.
Only the head of each text/JSON file is read; parquet is checked by pyarrow's own schema reader.
"""
from __future__ import annotations

import json
from pathlib import Path

from memtrain.config.recipe import DataSection
from memtrain.errors import UserError, not_utf8
from memtrain.model.corpus_reader import builder_for

HEAD = 1 << 16  # bytes of each text/JSON file looked at
JSON_LINES = 20  # JSON lines parsed per file


def check_seq_len(data: DataSection) -> None:
    if data.seq_len < 2:
        raise UserError(f"data.seq_len: {data.seq_len} leaves no next token to predict (the labels are the "
                        "inputs shifted by one); expected 2 or more")


def check_data_files(files: list[Path], data: DataSection) -> None:
    """Each file's head: text, or JSON lines / parquet holding the column the data format reads."""
    column = column_read(data)
    for f in files:
        builder = builder_for(f)
        if f.stat().st_size == 0:
            continue  # empty files are allowed beside others (check_text covers all-empty)
        if builder == "parquet":
            _check_parquet(f, column)
        else:
            text = _head_text(f)
            if builder == "json":
                _check_json(f, text, column)


def column_read(data: DataSection) -> tuple[str, str]:
    """(recipe key, column) of the column every record must hold for `data.format`."""
    return {"text": ("text_key", data.text_key), "chat": ("messages_key", data.messages_key),
            "instruction": ("prompt_key", data.prompt_key)}[data.format]


def _head_text(f: Path) -> str:
    with open(f, "rb") as fh:
        head = fh.read(HEAD)
    if b"\0" in head:
        raise UserError(f"data.paths: {f}: binary data (a NUL byte at offset {head.index(0)}); expected text "
                        f"({f.suffix or 'no suffix'} files are read as text)")
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start >= len(head) - 3 and len(head) == HEAD:  # a character cut by the head's end
            return head[:e.start].decode("utf-8")
        raise UserError(f"data.paths: {f}: {not_utf8(e)}") from None


def _check_json(f: Path, head: str, key: tuple[str, str]) -> None:
    """JSON lines (or one JSON array/object for .json), each record an object holding `key` as text."""
    lines = head.splitlines()
    if len(head.encode()) == HEAD and lines:
        lines = lines[:-1]  # the last line may be cut by the head's end
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            if f.suffix.lower() == ".json" and not records:
                return _check_json_document(f, key)
            raise UserError(f"data.paths: {f}: line {n}: malformed JSON ({e.msg} at column {e.colno}); "
                            "expected one JSON object per line") from None
        if len(records) >= JSON_LINES:
            break
    for n, record in records:
        _check_record(f, n, record, key)


def _check_json_document(f: Path, key: tuple[str, str]) -> None:
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"data.paths: {f}: malformed JSON ({getattr(e, 'msg', e)}); expected JSON lines "
                        "or one JSON array of objects") from None
    for n, record in enumerate(doc[:JSON_LINES] if isinstance(doc, list) else [doc], 1):
        _check_record(f, n, record, key, what="record")


def _check_record(f: Path, n: int, record, key: tuple[str, str], what: str = "line") -> None:
    name, column = key
    if not isinstance(record, dict):
        raise UserError(f"data.paths: {f}: {what} {n}: a JSON {type(record).__name__}, expected an object "
                        f"with a '{column}' field")
    if column not in record:
        raise UserError(f"data.{name}: '{column}' is not a field of {f} ({what} {n} has: "
                        f"{', '.join(list(record)[:8]) or 'no fields'})")


def _check_parquet(f: Path, key: tuple[str, str]) -> None:
    name, key = key
    import pyarrow.parquet as pq  # noqa: PLC0415 pyarrow: heavy, imported only when this runs

    try:
        names = pq.read_schema(f).names
    except Exception as e:  # pyarrow's ArrowInvalid and OSError for a file that is no parquet
        raise UserError(f"data.paths: {f}: not a parquet file ({str(e).strip().splitlines()[0]})") from None
    if key not in names:
        raise UserError(f"data.{name}: '{key}' is not a column of {f} (columns: {', '.join(names[:8])})")

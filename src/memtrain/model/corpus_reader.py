"""A corpus's files (data.paths, or the default corpus) and its documents, streamed in order through `datasets`
(text: one document per file; JSON lines, JSON, parquet: one per row), up to data.max_bytes characters; memory
stays bounded by a batch of rows."""
from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional
import json

from memtrain.config.recipe import DataSection
from memtrain.errors import NodeError, UserError

BATCH = 256  # rows per `datasets` batch
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # everything else: "text"


def builder_for(path: Path) -> str:
    """The `datasets` builder that reads a data file, by its suffix: json, parquet, or text."""
    return _BUILDERS.get(path.suffix.lower(), "text")


def default_corpus_files() -> list[Path]:
    """The embedded default corpus: this Python's own standard-library sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def resolve_files(cfg: DataSection) -> list[Path]:
    """data.paths' files in order (each pattern's matches sorted), every source's for a blend, or the default
    corpus's."""
    if cfg.sources:
        return [f for i, source in enumerate(cfg.sources) for f in _matches(source.paths, f"data.sources[{i}].paths")]
    if not cfg.paths:
        files = default_corpus_files()
        if not files:
            raise UserError("data.paths: empty, and no standard-library sources were found for the default corpus")
        return files
    return _matches(cfg.paths, "data.paths")


def source_sections(cfg: DataSection) -> list[DataSection]:
    """A blend's sources, each as the data section of a corpus of its own (its paths, the other keys shared)."""
    return [cfg.model_copy(update={"paths": source.paths, "sources": []}) for source in cfg.sources]


def _matches(patterns: list[str], key: str) -> list[Path]:
    files: list[Path] = []
    for i, pattern in enumerate(patterns):
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [Path(m) for m in matches if Path(m).is_file()]
        if not matches:
            raise NodeError(f"{key}[{i}]: '{pattern}' matches no file")
        files.extend(matches)
    return files


def documents(files: list[Path], cfg: DataSection) -> Iterator[str]:
    """Non-blank documents in file order (grouped by builder, as the files' first appearance orders them), the last
    one cut so that at most data.max_bytes characters are read."""
    return (text for text, _ in positioned_documents(files, cfg))


def positioned_documents(files: list[Path], cfg: DataSection, start: Optional[dict] = None) -> Iterator[tuple[str, dict]]:
    """As `documents`, each with the reading position just after it, and from such a position (`start`), so that a
    build can continue where an interrupted one stopped. A position is JSON: the builder group, the `datasets`
    stream's state before the batch that holds the document (files before it are skipped unread), the rows of that
    batch read, and the characters left of data.max_bytes."""
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault(builder_for(f), []).append(str(f))
    start = start or {"group": 0, "state": None, "rows": 0, "budget": cfg.max_bytes}
    budget = start["budget"]
    for g, (builder, paths) in enumerate(groups.items()):
        if g < start["group"]:
            continue
        at = start if g == start["group"] else {"state": None, "rows": 0}
        column = "text" if builder == "text" else cfg.text_key
        for state, row, (text,) in _stream(builder, paths, {column: "text_key"}, [], at["state"], at["rows"]):
            if isinstance(text, str) and text.strip():
                if budget is not None:
                    text = text[:budget]
                    budget -= len(text)
                yield text, {"group": g, "state": state, "rows": row + 1, "budget": budget}
                if budget is not None and budget <= 0:
                    return


def positioned_records(files: list[Path], required: dict[str, str], optional: list[str],
                       start: Optional[dict] = None) -> Iterator[tuple[dict, dict]]:
    """Every row of JSON-lines, JSON or parquet `files` in order, as a dict of the `required` columns (column: the
    recipe key that names it) and those of `optional` its file has, each with the reading position just after it
    (as `positioned_documents`'; one group per file, so that files may differ in their optional columns)."""
    start = start or {"group": 0, "state": None, "rows": 0}
    for g, f in enumerate(files):
        if g < start["group"]:
            continue
        at = start if g == start["group"] else {"state": None, "rows": 0}
        names: list[str] = []  # filled by _stream before its first row
        for state, row, values in _stream(builder_for(f), [str(f)], required, optional, at["state"], at["rows"],
                                          names):
            yield dict(zip(names, values)), {"group": g, "state": state, "rows": row + 1}


def _stream(builder: str, paths: list[str], required: dict[str, str], optional: list[str], state: Optional[dict],
            skip: int, names_out: Optional[list] = None) -> Iterator:
    """(stream state before the row's batch, row in the batch, the row's values of the columns read) of every row of
    `paths`, streamed from `state` with the first `skip` rows of its batch left out; `names_out` receives the columns
    read (the `required` ones, then those of `optional` present). A file it cannot read is named in one line, with
    its row."""
    try:
        ds, names = _load(builder, paths, required, optional)
        if names_out is not None:
            names_out.extend(names)
        if state is not None:
            ds.load_state_dict(state)
        before = state
        for batch in ds.iter(batch_size=BATCH):
            for row, values in enumerate(zip(*(batch[name] for name in names))):
                if row >= skip:
                    yield before, row, values
            skip = 0
            before = ds.state_dict()
    except (UserError, NodeError):
        raise
    except Exception as e:  # a corrupt file surfaces as one of many datasets/arrow errors, mid-stream
        raise _locate(builder, paths, required, e) from None


def _load(builder: str, paths: list[str], required: dict[str, str], optional: list[str] = ()):
    """The streamed dataset of the columns read, and their names."""
    import datasets  # noqa: PLC0415 datasets: heavy, imported only when this runs

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read: memtrain's one line says so
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    ds = datasets.load_dataset(builder, data_files=paths, split="train", streaming=True, **kwargs)
    names = list(ds.features) if ds.features is not None else None
    if names is None:
        return ds, list(required)
    for column, key in required.items():
        if column not in names:
            raise UserError(f"data.{key}: column '{column}' not in {paths[0]} (columns: {', '.join(names)})")
    read = list(required) + [c for c in optional if c in names and c not in required]
    return ds.select_columns(read), read


def _locate(builder: str, paths: list[str], required: dict[str, str], error: Exception) -> Exception:
    """The one line for a read that failed mid-stream: the first file that fails alone (read again file by file:
    only on this error path), and in JSON lines the first line that does not parse."""
    for path in paths:
        try:
            for _ in _load(builder, [path], required)[0].iter(batch_size=BATCH):
                pass
        except UserError as e:
            return e
        except Exception as e:  # as above
            return NodeError(f"data.paths: cannot read {path}{_bad_line(path)}: {str(e).splitlines()[0]}")
    return NodeError(f"data.paths: cannot read {builder} files ({paths[0]} ...): {str(error).splitlines()[0]}")


def _bad_line(path: str) -> str:
    """' (line N)' for the first line of a JSON-lines file that is not JSON, else ''."""
    if not path.lower().endswith(".jsonl"):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            try:
                if line.strip():
                    json.loads(line)
            except ValueError:
                return f" (line {n})"
    return ""

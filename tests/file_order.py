"""The order pytest runs test files in: longest first, from the seconds each file took in a recorded run.

`make test` spreads whole files over its xdist workers (`--dist loadfile --no-loadscope-reorder`), handing the next
file to whichever worker frees up. Started longest first, the last files to start are short, so the workers finish
together (longest-processing-time-first scheduling). xdist's own order (most tests first) started the long one- and
two-test launch files last, and one worker ran on alone for up to a launch's length.

`tests/file_seconds.json` holds the seconds per file (setup + call + teardown of its tests). A file it does not list
counts 0 and keeps its collection order after the listed ones. Refresh the table from a full run:

    MEMTRAIN_FILE_SECONDS=tests/file_seconds.json make test

(make test alone: a file's entry is replaced by what the recording session ran of it, and make test-multinode runs
test_slurm.py's one multinode test.)
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items) -> None:
    seconds = json.loads(TABLE.read_text())
    items.sort(key=lambda item: -seconds.get(file_of(item.nodeid), 0.0))  # stable: a file's tests stay in order


class FileSeconds:
    """Sums each file's test durations (in xdist's controller: every worker's reports) and writes them to `out`,
    keeping the table's other files."""

    def __init__(self, out: Path):
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        table = json.loads(self.out.read_text()) if self.out.exists() else {}
        table.update({f: round(s, 1) for f, s in self.seconds.items()})
        self.out.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: -kv[1])), indent=1) + "\n")


def pytest_configure(config) -> None:
    out = os.environ.get("MEMTRAIN_FILE_SECONDS")
    if out and not hasattr(config, "workerinput"):  # the controller (or a run without xdist), not its workers
        config.pluginmanager.register(FileSeconds(Path(out)), "memtrain-file-seconds")

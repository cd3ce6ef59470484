"""The resume file of a batch job: one JSON line per finished row, appended and flushed as each row completes.

A job killed at any moment (Ctrl-C, SIGKILL, a crash) leaves every finished row in this file; a half-written last
line is ignored on reading. Each record carries a fingerprint of what produced it (the row's prompt, the model and
the sampling parameters), so a rerun reuses a record only when the same row would be generated the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from .datasets_io import is_hub_id

logger = logging.getLogger(__name__)


def checkpoint_path_for(output: str) -> Path:
    """Next to the output file; for a Hub dataset id, in the current folder."""
    if is_hub_id(output):
        return Path(output.replace("/", "__") + ".cbs-checkpoint.jsonl")
    path = Path(output)
    return path.with_name(path.name + ".cbs-checkpoint.jsonl")


def fingerprint(*parts) -> str:
    text = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class Checkpoint:
    """Append-only record of finished rows, keyed by (row, generation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[tuple[int, int], dict] = {}
        self._handle = None

    def load(self) -> int:
        """Read earlier records; returns how many were read. A torn last line (killed mid-write) is skipped."""
        if not self.path.exists():
            return 0
        skipped = 0
        # errors="replace": a line torn inside a multi-byte character must not make the whole file unreadable.
        with self.path.open("r", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    self.records[(int(record["row"]), int(record["generation"]))] = record
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    skipped += 1
        if skipped:
            logger.warning("Skipped %d unreadable line(s) in %s (a run was killed while writing)", skipped, self.path)
        return len(self.records)

    def reusable(self, key: tuple[int, int], expected_fingerprint: str, retry_failed: bool) -> dict | None:
        record = self.records.get(key)
        if record is None or record.get("fingerprint") != expected_fingerprint:
            return None
        if retry_failed and record.get("error"):
            return None
        return record

    def append(self, record: dict) -> None:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("a", encoding="utf-8")
            if self._handle.tell() and not self._ends_with_newline():
                self._handle.write("\n")  # close a torn line so the next record starts clean
        self.records[(record["row"], record["generation"])] = record
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()  # in the OS before the next row: survives SIGKILL of this process

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as handle:
            handle.seek(-1, 2)
            return handle.read(1) == b"\n"

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

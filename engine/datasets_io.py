"""Reading a dataset into a table and writing the result back out: files or the Hugging Face Hub.

Inputs: .csv, .tsv, .jsonl/.json, .parquet files, a local dataset folder, or a Hub dataset id (with subset,
split and max rows), the last two through `datasets.load_dataset`; with max rows it streams just those rows
instead of downloading the whole split. CSV and TSV cells are read as text exactly as
written (no "007" -> 7, no empty cell -> NaN), so every input column comes out as it went in.
Outputs: .csv, .jsonl, .parquet by extension, or a Hub dataset id (pushed with a dataset card).

Errors a user can fix raise `DataError` with the reason; nothing here generates text.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from pathlib import Path

import pandas as pd

logger = logging.getLogger(__name__)

INPUT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
OUTPUT_SUFFIXES = (".csv", ".jsonl", ".parquet")
_OTHER_FILE_SUFFIXES = (".txt", ".xlsx", ".xls", ".arrow", ".feather", ".pq", ".gz", ".zip", ".ndjson", ".md")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# JSON cells as written: no "2024-01-01" in a `created_at` column turned into a timestamp. pandas 3 does that with
# dtype=False alone (and deprecates convert_dates); pandas 2 still converts date-like column names without it.
_JSON_AS_WRITTEN = {"dtype": False} if int(pd.__version__.split(".")[0]) >= 3 else {"dtype": False,
                                                                                     "convert_dates": False}


class DataError(ValueError):
    """A dataset that cannot be read or written; the message says why and what to do."""


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and Path(name).suffix.lower() not in INPUT_SUFFIXES and not Path(name).exists()


def _read_file(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    if path.stat().st_size == 0:
        raise DataError(f"{path.name} is empty: there are no rows to generate from")
    try:
        if suffix in (".csv", ".tsv"):
            return pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",", dtype=str, keep_default_na=False,
                               encoding="utf-8")
        if suffix == ".jsonl" or (suffix == ".json" and _looks_like_json_lines(path)):
            return pd.read_json(path, lines=True, **_JSON_AS_WRITTEN)
        if suffix == ".json":
            return pd.read_json(path, **_JSON_AS_WRITTEN)
        if suffix == ".parquet":
            return pd.read_parquet(path)
    except UnicodeDecodeError as error:
        raise DataError(f"{path.name} is not UTF-8 text (is it a binary file?): {error.reason}") from None
    except pd.errors.EmptyDataError:
        raise DataError(f"{path.name} is empty: there are no rows to generate from") from None
    except (ValueError, pd.errors.ParserError, OSError) as error:
        raise DataError(f"Could not read {path.name} as {suffix[1:].upper()}: {_first_line(error)}") from None
    raise DataError(f"{path.name}: unsupported file type {suffix or '(none)'}; use one of "
                    f"{', '.join(INPUT_SUFFIXES)}")


def _looks_like_json_lines(path: Path) -> bool:
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        first = handle.readline().strip()
        second = handle.readline().strip()
    return first.startswith("{") and (not second or second.startswith("{"))


def _read_with_datasets(source: str, subset: str | None, split: str, max_samples: int | None) -> pd.DataFrame:
    import datasets

    folder = Path(source)
    try:
        if folder.is_dir() and ((folder / "dataset_dict.json").exists() or (
                (folder / "dataset_info.json").exists() and (folder / "state.json").exists())):
            loaded = datasets.load_from_disk(str(folder))  # written by Dataset(Dict).save_to_disk
        elif max_samples is not None:
            # Stream the first rows instead of downloading and converting the whole split.
            return _take_streamed(datasets.load_dataset(source, subset, split=split, streaming=True), max_samples)
        else:
            loaded = datasets.load_dataset(source, subset, split=split)
    except Exception as error:  # datasets raises many types (FileNotFound, DatasetNotFound, ValueError, HTTP...)
        raise DataError(f"Could not load dataset {source!r} (subset {subset!r}, split {split!r}): "
                        f"{_first_line(error)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"Dataset {source!r} has no split {split!r}; it has: {', '.join(loaded)}")
        loaded = loaded[split]
    return loaded.to_pandas()


def _take_streamed(streamed, max_samples: int) -> pd.DataFrame:
    import datasets

    # Plain iteration stops at the last row needed (IterableDataset.take reads ahead into the next shard).
    rows = list(itertools.islice(iter(streamed), max_samples))
    if streamed.features is not None:
        return datasets.Dataset.from_list(rows, features=streamed.features).to_pandas()
    return pd.DataFrame(rows)


def read_table(source: str, subset: str | None = None, split: str = "train",
               max_samples: int | None = None) -> pd.DataFrame:
    """Read a file, a local dataset folder or a Hub dataset into a DataFrame (at most max_samples rows)."""
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 1):
        # head(-N) would silently drop the last N rows instead.
        raise DataError(f"max_samples={max_samples!r} is not valid: give a whole number >= 1")
    path = Path(source)
    if path.is_file():
        table = _read_file(path)
    elif path.is_dir() or is_hub_id(source):
        table = _read_with_datasets(source, subset, split, max_samples)
    elif path.suffix.lower() in INPUT_SUFFIXES:
        raise DataError(f"File not found: {source}")
    else:
        raise DataError(f"{source!r} is neither a file ({', '.join(INPUT_SUFFIXES)}), a dataset folder, nor a Hub "
                        "dataset id like 'owner/name'")
    if len(table.columns) == 0 or len(table) == 0:
        raise DataError(f"{path.name or source} has no rows to generate from")
    table.columns = [str(column) for column in table.columns]
    if max_samples is not None:
        table = table.head(max_samples)
    return table.reset_index(drop=True)


def to_plain(value):
    """numpy arrays and pyarrow structs (as Parquet and Hub datasets give list columns) as plain Python lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [to_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    return value


def output_kind(output: str) -> str:
    suffix = Path(output).suffix.lower()
    if suffix in OUTPUT_SUFFIXES:
        return suffix[1:]
    if is_hub_id(output) and suffix not in _OTHER_FILE_SUFFIXES:  # "results/out.xlsx" is a file, not a repo
        return "hub"
    raise DataError(f"Output {output!r}: use a file ending in {', '.join(OUTPUT_SUFFIXES)} or a Hub dataset id "
                    "like 'owner/name'")


def write_table(table: pd.DataFrame, output: str) -> Path:
    """Write to a local .csv, .jsonl or .parquet file (atomically: a crash never leaves half a file)."""
    kind = output_kind(output)
    if kind == "hub":
        raise DataError("write_table writes files; use push_to_hub for a Hub dataset id")
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        if kind == "csv":
            # "\r\n" (the csv module's own default) makes the writer quote any cell holding "\r" or "\n"; with
            # pandas' "\n" a lone "\r" (models do generate one) is written bare and splits the row when read back.
            table.to_csv(partial, index=False, encoding="utf-8", lineterminator="\r\n")
        elif kind == "jsonl":
            table.to_json(partial, orient="records", lines=True, force_ascii=False)
        else:
            table.to_parquet(partial, index=False)
        os.replace(partial, path)
    except (ValueError, TypeError, OSError) as error:  # pyarrow's type errors subclass these; so do disk errors
        partial.unlink(missing_ok=True)
        raise DataError(f"Could not write {path}: {_first_line(error)}") from None
    return path


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def dataset_card(repo_id: str, details: dict) -> str:
    lines = ["---", "tags:", "- cb-studio", "- synthetic", "---", "", f"# {repo_id}", "",
             "Responses generated with [CB Studio](https://github.com/) on transformers' continuous batching.", "",
             "| setting | value |", "| --- | --- |"]
    for key, value in details.items():
        if key != "command":
            lines.append(f"| {key} | `{json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value}` |")
    lines += ["", "Reproduce with:", "", "```bash", details.get("command", ""), "```", ""]
    return "\n".join(lines)


def push_to_hub(table: pd.DataFrame, repo_id: str, details: dict, private: bool = False) -> str:
    """Push the result and a dataset card to the Hub. The token comes from HF_TOKEN (or the login cache)."""
    import datasets
    from huggingface_hub import DatasetCard

    token = os.environ.get("HF_TOKEN") or None
    try:
        dataset = datasets.Dataset.from_pandas(table, preserve_index=False)
        dataset.push_to_hub(repo_id, private=private, token=token)
        DatasetCard(dataset_card(repo_id, details)).push_to_hub(repo_id, repo_type="dataset", token=token)
    except Exception as error:  # network, auth and permission errors all end the same way for the user
        reason = _first_line(error)
        if token:
            reason = reason.replace(token, "***")  # never print the token, even if an error message echoes it
        raise DataError(f"Could not push to the Hub dataset {repo_id!r}: {reason} "
                        "(set HF_TOKEN to a token with write access)") from None
    return f"https://huggingface.co/datasets/{repo_id}"

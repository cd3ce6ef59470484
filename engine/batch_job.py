"""A batch job: a table of rows in, one response per row (or N) out, resumable. Used by the CLI and the app.

The job checks everything it can before generating (the columns exist, the template's fields are columns), turns
each row into a prompt (a prompt column, a messages column, or a `{column}` template), runs the rows through the
shared engine (`Engine.generate_many`), appends each finished row to a checkpoint, and assembles the output: every
input column, rows in input order, plus the response and its metadata.

A row that cannot run (empty prompt, malformed messages cell, prompt longer than the context) gets its `error`
text and an empty response; the job goes on. Reading and writing files is engine.datasets_io's job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import string
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from .checkpoint import Checkpoint, fingerprint
from .config import SamplingParams
from .datasets_io import to_plain
from .engine import BatchRequest, Engine
from .prompts import PromptError, normalize_messages
from .results import GenerationResult

logger = logging.getLogger(__name__)

MAX_GENERATIONS = 64
RESULT_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "error")


class JobError(ValueError):
    """The job cannot start; nothing was generated. The message says what to change."""


@dataclass(frozen=True)
class JobSpec:
    """What to generate from and how. Exactly one of prompt_column, messages_column, template."""

    prompt_column: str | None = None
    messages_column: str | None = None
    template: str | None = None
    system_prompt: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    num_generations: int = 1
    enable_thinking: bool | None = None
    output_column: str = "response"
    retry_failed: bool = False

    def __post_init__(self) -> None:
        chosen = [name for name in ("prompt_column", "messages_column", "template") if getattr(self, name)]
        if len(chosen) > 1:
            raise JobError(f"choose one of prompt column, messages column or template, not {' and '.join(chosen)}")
        if isinstance(self.num_generations, bool) or not isinstance(self.num_generations, int) or not (
                1 <= self.num_generations <= MAX_GENERATIONS):
            raise JobError(f"num_generations={self.num_generations!r} is not valid: must be 1 to {MAX_GENERATIONS}")
        if not self.output_column or not str(self.output_column).strip():
            raise JobError("output_column must be a non-empty name")

    @property
    def mode(self) -> str:
        return "template" if self.template else "messages" if self.messages_column else "prompt"


@dataclass
class JobProgress:
    total: int
    done: int = 0
    failed: int = 0
    resumed: int = 0
    tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    generated_this_run: int = 0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        remaining = self.total - self.done
        if remaining <= 0:
            return 0.0
        if self.generated_this_run == 0:
            return None
        return remaining * self.elapsed_s / self.generated_this_run


@dataclass
class JobResult:
    table: pd.DataFrame
    progress: JobProgress
    cancelled: bool = False
    checkpoint: Path | None = None

    @property
    def failed_rows(self) -> list[int]:
        errors = self.table["error"] if "error" in self.table else pd.Series([], dtype=str)
        return [int(i) for i in errors.index[errors.astype(bool)]]


def template_fields(template: str) -> list[str]:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise JobError(f"The template is malformed: {error} (write literal braces as {{{{ and }}}})") from None
    for name in names:
        if not name or name.isdigit():
            raise JobError("Template placeholders must name a column, like {question}; found {"
                           f"{name}" + "}")
    return names


def resolve_spec(table: pd.DataFrame, spec: JobSpec) -> JobSpec:
    """Check the spec against the table's columns (before any generation) and fill the default source."""
    columns = list(table.columns)
    listing = ", ".join(columns)
    if spec.mode == "prompt" and not spec.prompt_column:
        for default in ("messages", "prompt"):
            if default in columns:
                key = "messages_column" if default == "messages" else "prompt_column"
                spec = JobSpec(**{**asdict(spec), "params": spec.params, key: default})
                break
        else:
            raise JobError(f"Say what to generate from: --prompt-column, --messages-column or --template. "
                           f"Columns: {listing}")
    for name in (spec.prompt_column, spec.messages_column):
        if name and name not in columns:
            raise JobError(f"Column {name!r} not found. Columns: {listing}")
    if spec.template:
        unknown = [name for name in template_fields(spec.template) if name not in columns]
        if unknown:
            raise JobError(f"Template field(s) {', '.join('{' + u + '}' for u in unknown)} are not columns. "
                           f"Columns: {listing}")
        if not template_fields(spec.template):
            raise JobError("The template has no {column} placeholder: every row would get the same prompt")
        try:  # a format spec or attribute lookup that no text cell can satisfy fails here, not on every row
            spec.template.format(**{name: "" for name in columns})
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as error:
            raise JobError(f"The template cannot be filled in: {error!r}. Placeholders are plain column names "
                           "like {question}; write literal braces as {{ and }}") from None
    reserved = [*RESULT_COLUMNS, "reasoning", "generation"]
    if spec.output_column in reserved:
        raise JobError(f"--output-column {spec.output_column!r} is a column the job writes itself; choose another "
                       f"name than {', '.join(reserved)}")
    produced = _output_columns(pd.DataFrame(), spec)
    clash = [name for name in produced if name in columns]
    if clash:
        own = [name for name in clash if name != spec.output_column]
        fix = (f"Rename or drop the input column(s) {', '.join(own)}" if own else "Rename that input column")
        raise JobError(f"The input already has column(s) {', '.join(clash)}, which the output would overwrite. "
                       f"{fix}, or choose another --output-column than {spec.output_column!r}.")
    return spec


def _cell_text(value) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    return str(value)


def row_prompt(row: dict, spec: JobSpec) -> dict:
    """The prompt or messages for one row, as keyword arguments for the engine. Raises PromptError."""
    if spec.mode == "template":
        values = {name: _cell_text(value) for name, value in row.items()}
        try:
            return {"prompt": spec.template.format(**values)}
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as error:
            raise PromptError(f"the template cannot be filled in for this row: {error!r}") from None
    if spec.mode == "messages":
        cell = to_plain(row[spec.messages_column])
        if isinstance(cell, str):
            if not cell.strip():
                raise PromptError("the messages cell is empty")
            try:
                cell = json.loads(cell)
            except json.JSONDecodeError as error:
                raise PromptError(f"the messages cell is not valid JSON ({error.msg} at character {error.pos})") \
                    from None
        return {"messages": normalize_messages(cell)}
    text = _cell_text(row[spec.prompt_column])
    if not text.strip():
        raise PromptError("the prompt cell is empty")
    return {"prompt": text}


def _record(row: int, generation: int, fp: str, result: GenerationResult) -> dict:
    return {"row": row, "generation": generation, "fingerprint": fp, "response": result.text,
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens, "error": result.error or "",
            "reasoning": result.reasoning or ""}


def _error_result(message: str) -> GenerationResult:
    return GenerationResult(text="", finish_reason="error", error=message)


def assemble(table: pd.DataFrame, spec: JobSpec, records: dict[tuple[int, int], dict],
             unfinished: str = "cancelled") -> pd.DataFrame:
    """Input columns in input order, one row per (row, generation), plus the result columns.

    A row without a record gets an empty response and `unfinished` as its finish_reason.
    """
    rows = []
    plain = table.to_dict("records")
    for index, source in enumerate(plain):
        for generation in range(spec.num_generations):
            record = records.get((index, generation))
            out = dict(source)
            if spec.num_generations > 1:
                out["generation"] = generation
            out[spec.output_column] = record["response"] if record else ""
            for name in RESULT_COLUMNS:
                default = 0 if name.endswith("tokens") else (unfinished if name == "finish_reason" else "")
                out[name] = record[name] if record else default
            if spec.enable_thinking:
                out["reasoning"] = record["reasoning"] if record else ""
            rows.append(out)
    return pd.DataFrame(rows, columns=_output_columns(table, spec))


def _output_columns(table: pd.DataFrame, spec: JobSpec) -> list[str]:
    columns = list(table.columns) + (["generation"] if spec.num_generations > 1 else [])
    columns += [spec.output_column, *RESULT_COLUMNS]
    return columns + (["reasoning"] if spec.enable_thinking else [])


@dataclass
class JobUpdate:
    """What `iter_job` yields: the progress so far and, on the last update, the result.

    `progress` and `records` are the job's live state (copying them for every row would cost O(rows^2)): call
    `partial_table()` when the update arrives, not after the job has gone on.
    """

    progress: JobProgress
    table: pd.DataFrame
    spec: JobSpec
    records: dict[tuple[int, int], dict]
    result: JobResult | None = None

    def partial_table(self) -> pd.DataFrame:
        """The output so far: finished rows filled in, the others `pending` with an empty response."""
        if self.result is not None:
            return self.result.table
        return assemble(self.table, self.spec, self.records, unfinished="pending")


def iter_job(engine: Engine, table: pd.DataFrame, spec: JobSpec, *, checkpoint: Checkpoint | None = None,
             on_result: Callable[[int, int, dict], None] | None = None,
             cancel_event: threading.Event | None = None) -> Iterator[JobUpdate]:
    """Run the job, yielding an update once the rows are submitted, after each finished row, and a last one with
    `result` set. Raises JobError on the first `next()` when the job cannot start. Closing the iterator cancels the
    rows in flight (finished rows stay in the checkpoint); so does setting `cancel_event`.
    """
    spec = resolve_spec(table, spec)
    # What decides a row's answer besides its prompt. max_new_tokens=None means the engine's default: record the
    # value in effect, so a rerun with another default does not reuse answers cut at the old length.
    settings = {"model": engine.config.model_id, "revision": engine.config.revision,
                "params": asdict(spec.params), "system_prompt": spec.system_prompt,
                "max_new_tokens": spec.params.max_new_tokens or engine.config.max_new_tokens,
                "enable_thinking": spec.enable_thinking, "mode": spec.mode}
    progress = JobProgress(total=len(table) * spec.num_generations)
    records: dict[tuple[int, int], dict] = {}

    def finish(key: tuple[int, int], fp: str, result: GenerationResult) -> None:
        record = _record(key[0], key[1], fp, result)
        records[key] = record
        if checkpoint is not None:
            checkpoint.append(record)
        progress.done += 1
        progress.generated_this_run += 1
        progress.failed += bool(record["error"])
        progress.tokens += result.completion_tokens
        if on_result is not None:
            on_result(key[0], key[1], record)

    cancelled = False
    try:
        if checkpoint is not None:
            checkpoint.load()
        fingerprints: dict[tuple[int, int], str] = {}
        requests: list[BatchRequest] = []
        for index, row in enumerate(table.to_dict("records")):
            try:
                prompt_kwargs, problem = row_prompt(row, spec), None
            except PromptError as error:
                prompt_kwargs, problem = {}, str(error)
            for generation in range(spec.num_generations):
                key = (index, generation)
                fp = fingerprint(settings, index, generation, prompt_kwargs or problem)
                fingerprints[key] = fp
                reused = checkpoint.reusable(key, fp, spec.retry_failed) if checkpoint is not None else None
                if reused is not None:
                    records[key] = reused
                    progress.done += 1
                    progress.resumed += 1
                    progress.failed += bool(reused.get("error"))
                    if on_result is not None:
                        on_result(index, generation, reused)
                    continue
                if problem is not None:
                    finish(key, fp, _error_result(problem))
                    continue
                params = spec.params
                if params.seed is not None and generation:  # wraps inside the valid seed range
                    params = SamplingParams(**{**asdict(params), "seed": (params.seed + generation) % 2**63})
                requests.append(BatchRequest(key=key, system_prompt=spec.system_prompt, params=params,
                                             enable_thinking=spec.enable_thinking, **prompt_kwargs))
        if progress.resumed:
            logger.info("Resumed %d finished row(s) from %s", progress.resumed, checkpoint.path)
        yield JobUpdate(progress, table, spec, records)

        results = engine.generate_many(requests, cancel_event=cancel_event)
        try:
            for key, result in results:
                if result.finish_reason != "cancelled":  # a cancelled row is not finished: a rerun generates it
                    finish(key, fingerprints[key], result)
                    yield JobUpdate(progress, table, spec, records)
            cancelled = cancel_event is not None and cancel_event.is_set() and progress.done < progress.total
        finally:
            results.close()
    finally:
        if checkpoint is not None:
            checkpoint.close()
    result = JobResult(table=assemble(table, spec, records), progress=progress, cancelled=cancelled,
                       checkpoint=checkpoint.path if checkpoint is not None else None)
    yield JobUpdate(progress, table, spec, records, result=result)


def run_job(engine: Engine, table: pd.DataFrame, spec: JobSpec, *, checkpoint: Checkpoint | None = None,
            on_progress: Callable[[JobProgress], None] | None = None,
            on_result: Callable[[int, int, dict], None] | None = None,
            cancel_event: threading.Event | None = None) -> JobResult:
    """Generate for every row of `table`, reusing finished rows from `checkpoint`. Raises JobError up front."""
    updates = iter_job(engine, table, spec, checkpoint=checkpoint, on_result=on_result, cancel_event=cancel_event)
    with contextlib.closing(updates):  # an exception here (Ctrl-C in a callback) still cancels the rows in flight
        for update in updates:
            if update.result is not None:
                return update.result
            if on_progress is not None:
                on_progress(update.progress)
    raise RuntimeError("the job ended without a result")  # unreachable: iter_job always yields one

"""Batch generation from a terminal or a Hugging Face Job: `python -m engine.cli INPUT OUTPUT [options]`.

The arguments follow the `generate-responses.py` scripts users know (`--model-id`, `--prompt-column`,
`--messages-column`, `--max-tokens`, `--max-batch-tokens`, `--subset`, `--split`, `--dtype`), plus templates,
stop strings, seeds, N generations per row, thinking, and resume: rerunning the same command after a crash,
Ctrl-C or SIGKILL picks up where it stopped. Everything is checked before the model loads.

Exit status: 0 when the job ran (even if some rows failed: they are listed), 2 when it could not run (bad input,
unknown column, model not found), 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import threading
from pathlib import Path

from .config import SamplingParams, add_engine_arguments, engine_config_from_args

logger = logging.getLogger("cb_studio.cli")

EXIT_OK, EXIT_CANNOT_RUN, EXIT_INTERRUPTED = 0, 2, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.cli",
        description="Generate a response for every row of a dataset with transformers' continuous batching.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("input", help="A .csv/.tsv/.jsonl/.json/.parquet file, a dataset folder, or a Hub dataset id")
    parser.add_argument("output", help="A .csv/.jsonl/.parquet file, or a Hub dataset id to push to")
    source = parser.add_argument_group("what to generate from (one of; default: a 'messages' or 'prompt' column)")
    source.add_argument("--prompt-column", help="Column holding the prompt, sent as one user message")
    source.add_argument("--messages-column", help="Column holding a list of {role, content} (or its JSON text)")
    source.add_argument("--template", help="Prompt template with {column} placeholders, e.g. 'Translate: {text}'")
    source.add_argument("--system-prompt", help="System prompt added to every row")
    data = parser.add_argument_group("input dataset")
    data.add_argument("--subset", help="Hub dataset configuration (subset)")
    data.add_argument("--split", default="train", help="Hub dataset split")
    data.add_argument("--max-samples", type=int, help="Use only the first N rows")
    sampling = parser.add_argument_group("sampling (default: the model's generation_config)")
    sampling.add_argument("--temperature", type=float, help="0 = greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int, help="0 = off")
    sampling.add_argument("--max-tokens", type=int, help="Most new tokens per response")
    sampling.add_argument("--stop", action="append", default=[], help="Stop string (repeat for several)")
    sampling.add_argument("--seed", type=int, help="Makes sampled responses reproducible")
    sampling.add_argument("--num-generations", type=int, default=1, help="Responses per row")
    sampling.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                          help="Ask templates that support it to think (adds a 'reasoning' column)")
    output = parser.add_argument_group("output")
    output.add_argument("--output-column", default="response")
    output.add_argument("--retry-failed", action="store_true", help="Rerun only the rows that failed last time")
    output.add_argument("--private", action="store_true", help="Make a pushed Hub dataset private")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_engine_arguments(parser)
    return parser


class _ProgressBar:
    """A tqdm bar with rows done and failed, tokens/s and ETA, fed by the job's progress callback."""

    def __init__(self) -> None:
        self._bar = None

    def __call__(self, progress) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=progress.total, initial=progress.done, unit="row", desc="Generating",
                             dynamic_ncols=True)
        self._bar.n = progress.done
        self._bar.set_postfix(failed=progress.failed, tok_s=f"{progress.tokens_per_second:.1f}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while reading the data, loading the model or writing: nothing half-done is kept
        logger.warning("Interrupted. Rows finished before the interruption are kept in the checkpoint; run the "
                       "same command again to resume.")
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        config = engine_config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)

    # Imported here so --help answers without pandas, datasets or torch.
    from .batch_job import JobError, JobSpec, resolve_spec
    from .datasets_io import DataError, output_kind, read_table
    from .engine import get_engine
    from .loader import ModelLoadError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed)
        spec = JobSpec(prompt_column=args.prompt_column, messages_column=args.messages_column,
                       template=args.template, system_prompt=args.system_prompt, params=params,
                       num_generations=args.num_generations, enable_thinking=args.enable_thinking,
                       output_column=args.output_column, retry_failed=args.retry_failed)
        kind = output_kind(args.output)
        if kind != "hub" and Path(args.output).resolve() == Path(args.input).resolve():
            raise DataError(f"The output {args.output} is the input file: write the results to another file "
                            "(the input would be overwritten and the command could not be rerun to resume)")
        table = read_table(args.input, subset=args.subset, split=args.split, max_samples=args.max_samples)
        spec = resolve_spec(table, spec)
    except (ValueError, DataError, JobError) as error:
        logger.error("%s", error)
        return EXIT_CANNOT_RUN
    logger.info("Read %d rows with columns: %s", len(table), ", ".join(table.columns))

    try:
        engine = get_engine(config)
    except (ModelLoadError, ValueError) as error:
        logger.error("%s", error)
        return EXIT_CANNOT_RUN

    try:
        return _run(engine, table, spec, params, config, args, argv, kind)
    finally:
        engine.shutdown()  # the generation thread is not a daemon: stop it so the process can exit


def _run(engine, table, spec, params, config, args, argv, kind) -> int:
    from .batch_job import JobError, run_job
    from .checkpoint import Checkpoint, checkpoint_path_for
    from .datasets_io import DataError, push_to_hub, write_table

    checkpoint = Checkpoint(checkpoint_path_for(args.output))
    bar = _ProgressBar()
    command = " ".join(shlex.quote(part) for part in ["python", "-m", "engine.cli", *(argv or sys.argv[1:])])
    try:
        result = run_job(engine, table, spec, checkpoint=checkpoint, on_progress=bar, cancel_event=threading.Event())
    except KeyboardInterrupt:
        bar.close()
        logger.warning("Interrupted. Finished rows are saved in %s; run the same command again to resume:\n  %s",
                       checkpoint.path, command)
        return EXIT_INTERRUPTED
    except JobError as error:
        bar.close()
        logger.error("%s", error)
        return EXIT_CANNOT_RUN
    bar.close()
    progress = result.progress
    if progress.resumed:
        print(f"Resumed {progress.resumed} of {progress.total} rows from {checkpoint.path}")

    try:
        if kind == "hub":
            details = {"model": config.model_id, **({"revision": config.revision} if config.revision else {}),
                       "input": args.input, "rows": len(table),
                       "generations_per_row": spec.num_generations, "failed": len(result.failed_rows),
                       "parameters": {k: v for k, v in vars(params).items() if v not in (None, ())},
                       "system_prompt": spec.system_prompt or "", "command": command}
            where = push_to_hub(result.table, args.output, details, private=args.private)
        else:
            where = str(write_table(result.table, args.output))
    except DataError as error:
        logger.error("%s (the results are kept in %s)", error, checkpoint.path)
        return EXIT_CANNOT_RUN

    failed = result.failed_rows
    print(f"Wrote {len(result.table)} rows to {where} ({progress.tokens} tokens generated this run, "
          f"{progress.tokens_per_second:.1f} tok/s).")
    if failed:
        # Numbered as input rows (0-based): with N generations per row the output has N rows for each of them.
        rows = sorted({i // spec.num_generations for i in failed})
        shown = ", ".join(str(i) for i in rows[:20]) + (" ..." if len(rows) > 20 else "")
        what = f"{len(failed)} response(s) of {len(rows)} input row(s)" if spec.num_generations > 1 else \
            f"{len(failed)} row(s)"
        print(f"{what} failed (see the 'error' column): {shown}. Rerun with --retry-failed to try them again.")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

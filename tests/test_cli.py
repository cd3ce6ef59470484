"""`python -m engine.cli`: exit codes, messages, resume after SIGKILL and Ctrl-C, Hub output.

Resume and Ctrl-C run the real CLI as a subprocess (a process has to die). The other tests call `engine.cli.main`
in this process with the model load replaced by the session's engine on the same tiny model (loading costs 5-8 s
per process; everything else, from parsing the flags to writing the file, is the real CLI). Tests of what happens
before the model loads replace the load with a failure, which proves the model is never loaded.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from engine import cli
from engine import engine as engine_module
from engine.batch_job import JobSpec, run_job
from engine.config import SamplingParams
from engine.datasets_io import read_table
from tests.conftest import greedy_reference

REPO = Path(__file__).resolve().parents[1]
HF_TOKEN = "hf_TESTsecretTOKEN0123456789"


def _decode_reference(engine, prompt: str, max_new_tokens: int) -> str:
    ids = engine.prepare(prompt=prompt).token_ids
    return engine.loaded.tokenizer.decode(greedy_reference(engine, ids, max_new_tokens), skip_special_tokens=True)


def _write_csv(path: Path, rows: list[list]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    return path


def _read_csv_records(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _valid_records(checkpoint: Path) -> list[dict]:
    records = []
    for line in checkpoint.read_bytes().decode("utf-8", errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line torn by the kill
            records.append(json.loads(line))
    return records


# ------------------------------------------------------------------------------------------- in-process runs --

@pytest.fixture
def run_cli(engine, tiny_model_path, monkeypatch, caplog, capsys):
    """Run `cli.main(argv)` here; returns (exit code, stdout, stderr + log text)."""
    def get_engine(config):
        assert config.model_id == engine.config.model_id and config.device == "cpu"
        return engine

    monkeypatch.setattr(engine_module, "get_engine", get_engine)
    monkeypatch.setattr(engine, "shutdown", lambda: None)  # the session's engine outlives one CLI run

    def run(*argv: str, model: str = tiny_model_path) -> tuple[int, str, str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            code = cli.main([*map(str, argv), "--model-id", model, "--device", "cpu"])
        out, err = capsys.readouterr()
        return code, out, err + "\n" + caplog.text

    return run


@pytest.fixture
def run_cli_no_model(run_cli, monkeypatch):
    """Like run_cli, but loading the model fails the test: these runs must stop before it."""
    def get_engine(config):
        raise AssertionError("the model was loaded although the job could not run")

    monkeypatch.setattr(engine_module, "get_engine", get_engine)
    return run_cli


def test_cannot_run_exits_2_with_the_reason_before_loading_the_model(run_cli_no_model, tmp_path, monkeypatch):
    run = run_cli_no_model
    data = _write_csv(tmp_path / "in.csv", [["id", "prompt"], ["007", "Hello"]])
    out = tmp_path / "out.csv"

    code, _, log = run(data, out, "--prompt-column", "prompt_text")
    assert code == 2 and "Column 'prompt_text' not found. Columns: id, prompt" in log

    code, _, log = run(data, out, "--template", "Translate to {language}: {prompt}")
    assert code == 2 and "Template field(s) {language} are not columns. Columns: id, prompt" in log

    (tmp_path / "empty.csv").write_bytes(b"")
    code, _, log = run(tmp_path / "empty.csv", out, "--prompt-column", "prompt")
    assert code == 2 and "empty.csv is empty" in log

    (tmp_path / "blob.csv").write_bytes(random.Random(0).randbytes(4096))
    code, _, log = run(tmp_path / "blob.csv", out, "--prompt-column", "prompt")
    assert code == 2 and "blob.csv is not UTF-8 text (is it a binary file?)" in log

    code, _, log = run(tmp_path / "nowhere.csv", out, "--prompt-column", "prompt")
    assert code == 2 and "File not found" in log

    code, _, log = run(data, out, "--prompt-column", "prompt", "--num-generations", "0")
    assert code == 2 and "num_generations=0" in log

    code, _, log = run(data, out, "--prompt-column", "prompt", "--output-column", "id")
    assert code == 2 and "already has column(s) id" in log

    code, _, log = run(data, data, "--prompt-column", "prompt")
    assert code == 2 and "is the input file" in log
    assert data.read_text(encoding="utf-8").splitlines() == ["id,prompt", "007,Hello"]  # input untouched

    monkeypatch.chdir(tmp_path)
    for wrong in ("out.xlsx", "results/out.xlsx", "results/out.json"):  # relative: not mistaken for Hub ids
        code, _, log = run(data, wrong, "--prompt-column", "prompt")
        assert code == 2 and "use a file ending in .csv, .jsonl, .parquet" in log, wrong

    code, _, log = run(data, out, "--prompt-column", "prompt", "--max-samples", "-1")
    assert code == 2 and "max_samples=-1" in log

    with pytest.raises(SystemExit) as exit_info:  # argparse: a flag that is not a number
        run(data, out, "--prompt-column", "prompt", "--temperature", "warm")
    assert exit_info.value.code == 2
    assert not out.exists() and not Path(f"{out}.cbs-checkpoint.jsonl").exists()


def test_flags_reach_the_job_and_retry_failed(run_cli, engine, tmp_path):
    data = _write_csv(tmp_path / "in.csv", [["id", "prompt"], ["a", "Name a fruit."], ["b", ""],
                                            ["c", "Name a colour."]])
    out = tmp_path / "out.jsonl"
    args = [data, out, "--prompt-column", "prompt", "--temperature", "0", "--max-tokens", "9",
            "--num-generations", "2", "--output-column", "answer"]
    code, stdout, _ = run_cli(*args)
    assert code == 0  # the job ran, even though one row failed
    assert "Wrote 6 rows to" in stdout
    assert "2 response(s) of 1 input row(s) failed (see the 'error' column): 1. Rerun with --retry-failed" in stdout
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [(r["id"], r["generation"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0),
                                                          ("c", 1)]
    for r in rows:
        expected = _decode_reference(engine, r["prompt"], 9) if r["prompt"] else ""
        assert r["answer"] == expected
        assert bool(r["error"]) == (r["id"] == "b")

    code, stdout, _ = run_cli(*args, "--retry-failed")
    assert code == 0
    assert "Resumed 4 of 6 rows" in stdout  # the two failed rows were tried again, the others reused
    assert "(0 tokens generated this run" in stdout


def test_hub_output_pushes_the_table_and_a_card_without_printing_the_token(run_cli, engine, tiny_model_path,
                                                                           tmp_path, monkeypatch):
    # Stand-ins for the two Hub calls: the Hub cannot be reached from the test machine. They record what the
    # CLI would have uploaded.
    import datasets
    from huggingface_hub import DatasetCard

    pushed = {}

    def dataset_push(self, repo_id, **kwargs):
        pushed["dataset"] = (repo_id, kwargs, self.to_pandas())

    def card_push(self, repo_id, **kwargs):
        pushed["card"] = (repo_id, kwargs, str(self))

    monkeypatch.setattr(datasets.Dataset, "push_to_hub", dataset_push)
    monkeypatch.setattr(DatasetCard, "push_to_hub", card_push)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.chdir(tmp_path)  # a Hub output keeps its checkpoint in the current folder
    data = _write_csv(tmp_path / "in.csv", [["prompt"], ["Say hi."], [""], ["Say bye."]])

    code, stdout, log = run_cli(data, "someone/cb-results", "--prompt-column", "prompt", "--temperature", "0",
                                "--max-tokens", "7", "--seed", "5", "--system-prompt", "Be kind.", "--private")
    assert code == 0, log
    assert "Wrote 3 rows to https://huggingface.co/datasets/someone/cb-results" in stdout

    repo_id, kwargs, table = pushed["dataset"]
    assert repo_id == "someone/cb-results" and kwargs == {"private": True, "token": HF_TOKEN}
    expected = [_decode_reference_with_system(engine, "Say hi."), "", _decode_reference_with_system(engine,
                                                                                                    "Say bye.")]
    assert list(table["response"]) == expected
    card_repo, card_kwargs, card = pushed["card"]
    assert card_repo == "someone/cb-results" and card_kwargs == {"repo_type": "dataset", "token": HF_TOKEN}
    assert f"| model | `{tiny_model_path}` |" in card
    assert "| rows | `3` |" in card and "| failed | `1` |" in card and "| generations_per_row | `1` |" in card
    assert '"temperature": 0.0' in card and '"max_new_tokens": 7' in card and '"seed": 5' in card
    assert "| system_prompt | `Be kind.` |" in card
    command = next(line for line in card.splitlines() if line.startswith("python -m engine.cli"))
    assert f"{data} someone/cb-results --prompt-column prompt --temperature 0 --max-tokens 7" in command
    assert "--system-prompt 'Be kind.'" in command
    assert (tmp_path / "someone__cb-results.cbs-checkpoint.jsonl").exists()
    for text in (stdout, log, card, command):
        assert HF_TOKEN not in text


def _decode_reference_with_system(engine, prompt: str) -> str:
    ids = engine.prepare(prompt=prompt, system_prompt="Be kind.").token_ids
    return engine.loaded.tokenizer.decode(greedy_reference(engine, ids, 7), skip_special_tokens=True)


def test_failed_push_exits_2_keeps_the_results_and_hides_the_token(run_cli, tmp_path, monkeypatch):
    # Stand-in for the Hub (unreachable here): a push that fails with a message echoing the token.
    import datasets

    def dataset_push(self, repo_id, **kwargs):
        raise PermissionError(f"401 Unauthorized for token {kwargs['token']}\nmore details")

    monkeypatch.setattr(datasets.Dataset, "push_to_hub", dataset_push)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.chdir(tmp_path)
    data = _write_csv(tmp_path / "in.csv", [["prompt"], ["One"], ["Two"]])
    code, stdout, log = run_cli(data, "someone/cb-results", "--prompt-column", "prompt", "--max-tokens", "5")
    assert code == 2
    assert "Could not push to the Hub dataset 'someone/cb-results': 401 Unauthorized for token ***" in log
    assert "someone__cb-results.cbs-checkpoint.jsonl" in log
    assert HF_TOKEN not in stdout + log
    assert len(_valid_records(tmp_path / "someone__cb-results.cbs-checkpoint.jsonl")) == 2  # nothing lost


# -------------------------------------------------------------------------------------------- real processes --

ROWS = 60
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def long_job(engine, tmp_path_factory):
    """60 prompts that take a few seconds, and the answers of an uninterrupted run of the same job."""
    folder = tmp_path_factory.mktemp("long-job")
    data = _write_csv(folder / "prompts.csv", [["id", "prompt"], *[
        [f"{i:03d}", ("the " * (i % 7)) + f"question number {i}, with a comma?"] for i in range(ROWS)]])
    reference = run_job(engine, read_table(str(data)), JobSpec(
        prompt_column="prompt", params=SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS)))
    assert reference.failed_rows == []
    return data, list(reference.table["response"])


def _command(tiny_model_path: str, data: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "engine.cli", str(data), str(output), "--model-id", tiny_model_path,
            "--device", "cpu", "--prompt-column", "prompt", "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]


def _env() -> dict:
    # CB_STUDIO_CACHE (set by the model_cache fixture) makes the subprocess reuse the built tiny model.
    assert os.environ.get("CB_STUDIO_CACHE")
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture
def start_cli():
    """Start the CLI in the background; whatever a failing test leaves running is killed afterwards."""
    started: list[subprocess.Popen] = []

    def start(command: list[str], logs: Path) -> subprocess.Popen:
        # Output to files: a pipe nobody reads while the process runs could fill up and block it.
        with (logs / "stdout").open("w") as out, (logs / "stderr").open("w") as err:
            process = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=out, stderr=err)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def _wait_for_records(process: subprocess.Popen, checkpoint: Path, logs: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if checkpoint.exists() and checkpoint.read_bytes().count(b"\n") >= 1:
            return
        if process.poll() is not None:
            pytest.fail(f"the CLI ended (rc {process.returncode}) before writing a row:\n"
                        f"{(logs / 'stderr').read_text()[-3000:]}")
        time.sleep(0.02)
    process.kill()
    pytest.fail("no row was finished in time")


def _finish(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _check_complete_output(output: Path, checkpoint: Path, expected: list[str]) -> None:
    records = _read_csv_records(output)
    assert [r["id"] for r in records] == [f"{i:03d}" for i in range(ROWS)]  # every row once, in input order
    assert [r["response"] for r in records] == expected  # the same answers as an uninterrupted run
    assert all(r["error"] == "" for r in records)
    rows = sorted(record["row"] for record in _valid_records(checkpoint))
    assert rows == list(range(ROWS))  # no row was generated twice: the resumed ones were reused


def _interrupt_mid_job(long_job, tiny_model_path, tmp_path, start_cli, signal_number: int):
    """Start the long job, send `signal_number` once rows are in the checkpoint; return what a test checks next."""
    data, expected = long_job
    output = tmp_path / "answers.csv"
    checkpoint = tmp_path / "answers.csv.cbs-checkpoint.jsonl"
    command = _command(tiny_model_path, data, output)
    process = start_cli(command, tmp_path)
    _wait_for_records(process, checkpoint, tmp_path)
    process.send_signal(signal_number)
    return process, data, expected, output, checkpoint, command


def _resume_and_check(command, output: Path, checkpoint: Path, expected: list[str]) -> None:
    """The rows saved before the interruption are left mid-job, the output is not written yet, and rerunning the
    same command reuses them and completes the output."""
    saved = {record["row"] for record in _valid_records(checkpoint)}
    assert 1 <= len(saved) < ROWS, "the interruption must land mid-job for this test to mean anything"
    assert not output.exists()
    rerun = _finish(command)
    assert f"Resumed {len(saved)} of {ROWS} rows" in rerun.stdout
    _check_complete_output(output, checkpoint, expected)


def test_resume_after_sigkill(long_job, tiny_model_path, tmp_path, start_cli):
    process, _, expected, output, checkpoint, command = _interrupt_mid_job(
        long_job, tiny_model_path, tmp_path, start_cli, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    _resume_and_check(command, output, checkpoint, expected)


def test_ctrl_c_exits_130_and_says_how_to_resume(long_job, tiny_model_path, tmp_path, start_cli):
    process, data, expected, output, checkpoint, command = _interrupt_mid_job(
        long_job, tiny_model_path, tmp_path, start_cli, signal.SIGINT)
    assert process.wait(timeout=60) == 130
    stderr = (tmp_path / "stderr").read_text()
    assert "Interrupted. Finished rows are saved in" in stderr and str(checkpoint) in stderr
    assert "run the same command again to resume" in stderr
    assert f"python -m engine.cli {data} {output} --model-id" in stderr  # the command to rerun
    _resume_and_check(command, output, checkpoint, expected)


def test_interrupt_outside_generation_exits_130(monkeypatch, tmp_path, caplog):
    """Ctrl-C while the data is read (or the model loads) ends with 130 too, not a traceback."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import engine.datasets_io as datasets_io

    monkeypatch.setattr(datasets_io, "read_table", interrupted)
    data = _write_csv(tmp_path / "in.csv", [["prompt"], ["x"]])
    with caplog.at_level(logging.INFO):
        try:
            code = cli.main([str(data), str(tmp_path / "out.csv"), "--prompt-column", "prompt"])
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped the CLI")
    assert code == 130
    assert "run the same command again to resume" in caplog.text


def test_pandas_independent_check_of_the_tricky_csv_through_the_cli(run_cli, engine, tmp_path):
    header = ["id", "price", "prompt", "note"]
    rows = [["007", "3.50", 'He said "hi",\nthen left.', ""], ["010", "", "", "empty, prompt"],
            ["-0", "NaN", "Emoji 😀 café", "null"]]
    data = _write_csv(tmp_path / "in.csv", [header, *rows])
    code, stdout, _ = run_cli(data, tmp_path / "out.csv", "--prompt-column", "prompt", "--temperature", "0",
                              "--max-tokens", "10")
    assert code == 0 and "1 row(s) failed (see the 'error' column): 1." in stdout
    written = _read_csv_records(tmp_path / "out.csv")
    assert [[r[name] for name in header] for r in written] == rows
    assert [r["response"] for r in written] == [_decode_reference(engine, rows[0][2], 10), "",
                                                _decode_reference(engine, rows[2][2], 10)]
    assert written[1]["error"] == "the prompt cell is empty"
    assert pd.read_csv(tmp_path / "out.csv", dtype=str, keep_default_na=False)["id"].tolist() == ["007", "010", "-0"]

"""The batch job as a library (read a table, run it on the shared engine, write it): inputs, exactness, resume.

Every test runs the real job on the session's tiny random Qwen2 engine. With temperature 0 each response must be
exactly what `model.generate` gives greedily for that row's chat-templated prompt; the weights are random, so the
answers are token soup (control characters, "\\r", broken UTF-8 included), which is what makes round trips through
files a real test.
"""

from __future__ import annotations

import csv
import json
import random
import threading

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.batch_job import JobError, JobSpec, resolve_spec, run_job
from engine.checkpoint import Checkpoint, checkpoint_path_for
from engine.config import SamplingParams
from engine.datasets_io import DataError, read_table, write_table
from tests.conftest import greedy_reference

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
RESULT_COLUMNS = ["response", "finish_reason", "prompt_tokens", "completion_tokens", "error"]


def _reference(engine, max_new_tokens: int = MAX_NEW, **prompt) -> str:
    """model.generate's greedy answer for a prompt (or messages) as the engine renders it, decoded like the engine."""
    ids = engine.prepare(**prompt).token_ids
    return engine.loaded.tokenizer.decode(greedy_reference(engine, ids, max_new_tokens), skip_special_tokens=True)


def _write_csv(path, rows: list[list[str]]) -> None:
    """Written with the csv module, independently of the code under test."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)


def _read_csv(path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def _assert_ok(table: pd.DataFrame, expected: list[str]) -> None:
    assert list(table["error"]) == [""] * len(expected)
    assert set(table["finish_reason"]) <= {"stop", "length"}
    assert list(table["response"]) == expected


# ----------------------------------------------------------------------------------------------- CSV fidelity --

TRICKY_HEADER = ["id", "price", "prompt", "note", "empty"]
TRICKY_ROWS = [
    ["007", "3.50", 'Say "hello", then stop.', "comma, inside", ""],
    ["008", "1e5", "line one\nline two\r\nline three", 'a "quoted" word', ""],
    ["0009", "", "Café 😀 naïve 数据集 ありがとう", "", ""],
    ["010", "NaN", "", "empty prompt: must fail", "null"],
    ["-0", "TRUE", "  padded prompt  ", " N/A ", "None"],
]


def test_csv_columns_survive_exactly_and_empty_prompt_fails(engine, tmp_path):
    source = tmp_path / "tricky.csv"
    _write_csv(source, [TRICKY_HEADER, *TRICKY_ROWS])

    table = read_table(str(source))
    result = run_job(engine, table, JobSpec(prompt_column="prompt", params=GREEDY))
    output = write_table(result.table, str(tmp_path / "out.csv"))

    written = _read_csv(output)  # read back with the csv module, not with the code under test
    assert written[0] == TRICKY_HEADER + RESULT_COLUMNS
    assert len(written) == 1 + len(TRICKY_ROWS)
    for source_row, out_row in zip(TRICKY_ROWS, written[1:], strict=True):
        assert out_row[:len(TRICKY_HEADER)] == source_row  # every input cell string-equal, rows in input order
        record = dict(zip(written[0], out_row, strict=True))
        if source_row[2] == "":
            assert record["response"] == ""
            assert record["finish_reason"] == "error"
            assert "empty" in record["error"]
        else:
            assert record["error"] == ""
            assert record["finish_reason"] in ("stop", "length")
            assert record["response"] == _reference(engine, prompt=source_row[2])
            assert int(record["completion_tokens"]) > 0
    assert result.failed_rows == [3]


def test_csv_output_round_trips_carriage_returns(tmp_path):
    """Models emit lone "\\r" characters; written unquoted, one would split its row in two when read back."""
    table = pd.DataFrame({"id": ["1", "2", "3"], "response": ["a\rb", "c\r\nd\n", "\x07\x1e\u2028"]})
    written = _read_csv(write_table(table, str(tmp_path / "cr.csv")))
    assert written == [["id", "response"], ["1", "a\rb"], ["2", "c\r\nd\n"], ["3", "\x07\x1e\u2028"]]
    assert read_table(str(tmp_path / "cr.csv")).equals(table)


# ---------------------------------------------------------------------------------------------- input formats --

SYSTEM = "You answer in one word."
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 😀"}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "one, two, three"},
     {"role": "user", "content": "Again, backwards."}],
]


def test_messages_jsonl_greedy_equals_generate(engine, tmp_path):
    source = tmp_path / "chats.jsonl"
    with source.open("w", encoding="utf-8") as handle:
        for i, messages in enumerate(CONVERSATIONS):
            # The last row stores its conversation as JSON text, as some datasets do.
            cell = json.dumps(messages) if i == len(CONVERSATIONS) - 1 else messages
            handle.write(json.dumps({"id": f"{i:03d}", "created_at": f"2024-01-0{i + 1}", "messages": cell},
                                    ensure_ascii=False) + "\n")

    table = read_table(str(source))
    assert list(table["created_at"]) == ["2024-01-01", "2024-01-02", "2024-01-03"]  # text, not timestamps
    result = run_job(engine, table, JobSpec(messages_column="messages", system_prompt=SYSTEM, params=GREEDY))
    assert list(result.table["id"]) == ["000", "001", "002"]
    _assert_ok(result.table, [_reference(engine, messages=m, system_prompt=SYSTEM) for m in CONVERSATIONS])


def test_parquet_list_of_structs_messages_and_prompt(engine, tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    prompts = ["Tell me a joke.", "Translate 'chat' to English.", "数据集 是 什么?"]
    arrow = pa.table({
        "n": pa.array([1, 2, 3], pa.int64()),
        "prompt": pa.array(prompts),
        "messages": pa.array(CONVERSATIONS, pa.list_(message)),
    })
    pq.write_table(arrow, tmp_path / "data.parquet")
    assert pq.read_schema(tmp_path / "data.parquet").field("messages").type == pa.list_(message)

    table = read_table(str(tmp_path / "data.parquet"))
    by_messages = run_job(engine, table, JobSpec(messages_column="messages", params=GREEDY))
    _assert_ok(by_messages.table, [_reference(engine, messages=m) for m in CONVERSATIONS])
    by_prompt = run_job(engine, table, JobSpec(prompt_column="prompt", system_prompt=SYSTEM, params=GREEDY))
    _assert_ok(by_prompt.table, [_reference(engine, prompt=p, system_prompt=SYSTEM) for p in prompts])

    # The Parquet output keeps the list-of-struct column and the input values.
    back = pq.read_table(write_table(by_messages.table, str(tmp_path / "out.parquet")))
    assert back.column("messages").to_pylist() == CONVERSATIONS
    assert back.column("n").to_pylist() == [1, 2, 3]
    assert back.column("response").to_pylist() == list(by_messages.table["response"])


def test_template_fills_columns(engine, tmp_path):
    _write_csv(tmp_path / "t.csv", [["text", "lang", "unused"], ["good morning", "French", "x"],
                                    ["{not a field}", "German", ""], ["3.50", "Japanese", "y"]])
    template = "Translate to {lang}: {text}"
    table = read_table(str(tmp_path / "t.csv"))
    result = run_job(engine, table, JobSpec(template=template, params=GREEDY))
    prompts = [template.format(text=t, lang=lang) for t, lang in zip(table["text"], table["lang"], strict=True)]
    assert prompts[1] == "Translate to German: {not a field}"  # a brace inside a cell is text, not a field
    _assert_ok(result.table, [_reference(engine, prompt=p) for p in prompts])


def test_max_samples_streams_only_the_rows_it_needs(tmp_path):
    """With max_samples, a dataset id or folder is streamed: the first rows come back without the rest of the split
    being read (here a corrupt second shard, which a full load would have to parse)."""

    folder = tmp_path / "shards"
    (folder / "data").mkdir(parents=True)
    pd.DataFrame({"prompt": [f"question {i}" for i in range(50)], "n": range(50)}).to_parquet(
        folder / "data" / "train-00000-of-00002.parquet")
    (folder / "data" / "train-00001-of-00002.parquet").write_bytes(b"not parquet at all")

    first = read_table(str(folder), max_samples=3)
    assert first.to_dict("list") == {"prompt": ["question 0", "question 1", "question 2"], "n": [0, 1, 2]}
    assert str(first["n"].dtype) == "int64"  # the dataset's own types, as without streaming
    with pytest.raises(DataError, match="Could not load dataset"):
        read_table(str(folder))  # the whole split includes the corrupt shard


def test_local_dataset_folders_read_through_datasets(engine, tmp_path):
    """A folder goes through `datasets` like a Hub id: load_dataset(folder) and save_to_disk folders."""
    import datasets

    prompts = ["First question?", "Second question, longer than the first one?"]
    folder = tmp_path / "folder"
    folder.mkdir()
    with (folder / "train.jsonl").open("w", encoding="utf-8") as handle:
        for i, prompt in enumerate(prompts):
            handle.write(json.dumps({"id": f"00{i}", "prompt": prompt}) + "\n")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"messages": CONVERSATIONS[:2], "k": [7, 8]}).save_to_disk(str(saved))
    split_saved = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": prompts}),
                          "test": datasets.Dataset.from_dict({"prompt": prompts[::-1]})}).save_to_disk(
        str(split_saved))

    from_folder = read_table(str(folder))
    assert from_folder.to_dict("list") == {"id": ["000", "001"], "prompt": prompts}
    _assert_ok(run_job(engine, from_folder, JobSpec(params=GREEDY)).table,  # default source: the 'prompt' column
               [_reference(engine, prompt=p) for p in prompts])

    from_disk = read_table(str(saved))
    assert list(from_disk.columns) == ["messages", "k"]
    _assert_ok(run_job(engine, from_disk, JobSpec(params=GREEDY)).table,  # default source: 'messages'
               [_reference(engine, messages=m) for m in CONVERSATIONS[:2]])

    assert list(read_table(str(split_saved), split="test")["prompt"]) == prompts[::-1]
    with pytest.raises(DataError, match=r"no split 'validation'.*train, test"):
        read_table(str(split_saved), split="validation")
    assert list(read_table(str(split_saved), max_samples=1)["prompt"]) == prompts[:1]


# -------------------------------------------------------------------------------------------------- bad input --

def test_missing_column_lists_the_columns(tmp_path):
    table = pd.DataFrame({"question": ["a"], "answer_key": ["b"]})
    with pytest.raises(JobError, match=r"Column 'prompt_text' not found\. Columns: question, answer_key"):
        resolve_spec(table, JobSpec(prompt_column="prompt_text"))
    with pytest.raises(JobError, match=r"--prompt-column, --messages-column or --template\. Columns: question"):
        resolve_spec(table, JobSpec())


def test_unreadable_files_say_why(tmp_path):
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.csv is empty"):
        read_table(str(tmp_path / "empty.csv"))
    (tmp_path / "header.csv").write_text("prompt,id\n", encoding="utf-8")
    with pytest.raises(DataError, match="no rows"):
        read_table(str(tmp_path / "header.csv"))
    (tmp_path / "blob.csv").write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(DataError, match=r"blob.csv is not UTF-8 text \(is it a binary file\?\)"):
        read_table(str(tmp_path / "blob.csv"))
    (tmp_path / "blob.parquet").write_bytes(random.Random(1).randbytes(4096))
    with pytest.raises(DataError, match=r"Could not read blob\.parquet as PARQUET"):
        read_table(str(tmp_path / "blob.parquet"))
    with pytest.raises(DataError, match="File not found"):
        read_table(str(tmp_path / "missing.jsonl"))
    _write_csv(tmp_path / "ok.csv", [["prompt"], ["a"], ["b"]])
    for bad in (0, -1):  # head(-1) would silently drop the last row
        with pytest.raises(DataError, match="max_samples"):
            read_table(str(tmp_path / "ok.csv"), max_samples=bad)


def test_bad_rows_fail_alone_and_the_job_goes_on(engine):
    good = [{"role": "user", "content": "Hello there"}]
    table = pd.DataFrame({"messages": [
        json.dumps(good),
        '[{"role": "user", "content": "unterminated}]',  # malformed JSON
        json.dumps([{"role": "user", "content": "the " * 1100}]),  # ~1100 tokens: over the 1024-token context
        "",
        json.dumps([{"role": "robot", "content": "hi"}]),
        json.dumps([*good, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "More"}]),
    ]})
    result = run_job(engine, table, JobSpec(messages_column="messages", params=GREEDY))
    out = result.table
    errors = list(out["error"])
    assert "not valid JSON" in errors[1]
    assert "context" in errors[2] and "1024" in errors[2]
    assert "empty" in errors[3]
    assert "role 'robot'" in errors[4]
    assert result.failed_rows == [1, 2, 3, 4]
    for i in (1, 2, 3, 4):
        assert out.loc[i, "response"] == "" and out.loc[i, "finish_reason"] == "error"
    assert list(out.loc[[0, 5], "response"]) == [_reference(engine, messages=json.loads(table.messages[i]))
                                                for i in (0, 5)]
    assert result.progress.done == 6 and result.progress.failed == 4


def test_template_problems_stop_the_job_before_it_runs(engine, tmp_path):
    table = pd.DataFrame({"text": ["a"], "lang": ["fr"]})
    checkpoint = Checkpoint(tmp_path / "ck.jsonl")
    with pytest.raises(JobError, match=r"Template field\(s\) \{language\} are not columns\. Columns: text, lang"):
        run_job(engine, table, JobSpec(template="To {language}: {text}"), checkpoint=checkpoint)
    assert not checkpoint.path.exists()  # nothing ran
    with pytest.raises(JobError, match="cannot be filled in"):
        resolve_spec(table, JobSpec(template="{text:d}"))  # a format spec no text satisfies
    with pytest.raises(JobError, match="must name a column"):
        resolve_spec(table, JobSpec(template="Say {}"))
    with pytest.raises(JobError, match="no \\{column\\} placeholder"):
        resolve_spec(table, JobSpec(template="Say {{hello}}"))


def test_output_column_clashes(engine):
    table = pd.DataFrame({"prompt": ["Hi"], "response": ["earlier answer"]})
    with pytest.raises(JobError, match=r"already has column\(s\) response.*another --output-column"):
        resolve_spec(table, JobSpec(prompt_column="prompt"))
    result = run_job(engine, table, JobSpec(prompt_column="prompt", output_column="answer", params=GREEDY))
    assert list(result.table.columns) == ["prompt", "response", "answer", *RESULT_COLUMNS[1:]]
    assert list(result.table["response"]) == ["earlier answer"]
    assert list(result.table["answer"]) == [_reference(engine, prompt="Hi")]

    with pytest.raises(JobError, match="writes itself"):  # would write two 'error' columns
        resolve_spec(table, JobSpec(prompt_column="prompt", output_column="error"))
    with pytest.raises(JobError, match="error"):
        resolve_spec(pd.DataFrame({"prompt": ["Hi"], "error": [""]}), JobSpec(prompt_column="prompt"))
    # Columns the job does not produce in this run are no clash: reasoning datasets often have 'reasoning'.
    with_reasoning = pd.DataFrame({"prompt": ["Hi"], "reasoning": ["kept"], "generation": ["kept too"]})
    assert resolve_spec(with_reasoning, JobSpec(prompt_column="prompt")).prompt_column == "prompt"
    with pytest.raises(JobError, match="reasoning"):
        resolve_spec(with_reasoning, JobSpec(prompt_column="prompt", enable_thinking=True))


def test_num_generations_gives_n_rows_per_input_row(engine):
    prompts = ["Pick a number.", "Pick a colour."]
    table = pd.DataFrame({"prompt": prompts, "id": ["a", "b"]})
    greedy = run_job(engine, table, JobSpec(num_generations=3, params=GREEDY)).table
    assert list(greedy.columns) == ["prompt", "id", "generation", *RESULT_COLUMNS]
    assert list(greedy["id"]) == ["a"] * 3 + ["b"] * 3
    assert list(greedy["generation"]) == [0, 1, 2, 0, 1, 2]
    assert list(greedy["response"]) == [_reference(engine, prompt=p) for p in prompts for _ in range(3)]

    # Sampled: generation g uses seed + g, so each is reproducible alone and the N answers differ.
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, seed=11)
    sampled = run_job(engine, table, JobSpec(num_generations=3, params=params)).table
    for (_, row) in sampled.iterrows():
        alone = engine.generate(prompt=row["prompt"], params=SamplingParams(
            temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, seed=11 + row["generation"]))
        assert row["response"] == alone.text
    assert len(set(sampled["response"][:3])) == 3
    last_seed = SamplingParams(temperature=1.0, max_new_tokens=2, seed=2**63 - 1)  # seed + 1 must stay valid
    assert run_job(engine, table.head(1), JobSpec(num_generations=2, params=last_seed)).failed_rows == []

    with pytest.raises(JobError, match="num_generations=0"):
        JobSpec(num_generations=0)


# ------------------------------------------------------------------------------------------ checkpoint/resume --

def _checkpoint_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_resume_reuses_only_matching_records_and_survives_a_torn_line(engine, tmp_path):
    prompts = [f"Question {i}: {'why ' * i}?" for i in range(5)]
    table = pd.DataFrame({"prompt": prompts})
    spec = JobSpec(params=GREEDY)
    path = checkpoint_path_for(str(tmp_path / "out.csv"))
    assert path.name == "out.csv.cbs-checkpoint.jsonl"
    first = run_job(engine, table, spec, checkpoint=Checkpoint(path))
    assert first.progress.resumed == 0 and first.progress.generated_this_run == 5
    _assert_ok(first.table, [_reference(engine, prompt=p) for p in prompts])

    # Killed while writing: keep two whole records and half of a third, cut inside a multi-byte character.
    lines = path.read_bytes().splitlines(keepends=True)
    torn = json.dumps({**json.loads(lines[2]), "response": "é" * 20}, ensure_ascii=False).encode()
    path.write_bytes(lines[0] + lines[1] + torn[:torn.index("é".encode()) + 1])

    again = run_job(engine, table, spec, checkpoint=Checkpoint(path))
    assert again.progress.resumed == 2 and again.progress.generated_this_run == 3
    assert again.table.equals(first.table)
    reloaded = Checkpoint(path)
    assert reloaded.load() == 5  # the torn line is skipped; the records after it start on a line of their own

    # Everything finished: a third run generates nothing.
    third = run_job(engine, table, spec, checkpoint=Checkpoint(path))
    assert third.progress.resumed == 5 and third.progress.tokens == 0
    assert third.table.equals(first.table)

    # Other settings produce other answers: nothing is reused.
    for other in (JobSpec(params=SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW + 1)),
                  JobSpec(params=GREEDY, system_prompt="Be brief.")):
        changed = run_job(engine, table.head(2), other, checkpoint=Checkpoint(path))
        assert changed.progress.resumed == 0


def test_retry_failed_reruns_only_the_failed_rows(engine, tmp_path):
    prompts = ["alpha", "beta", "gamma", "delta"]
    table = pd.DataFrame({"prompt": prompts})
    spec = JobSpec(params=GREEDY)
    path = tmp_path / "job.cbs-checkpoint.jsonl"
    run_job(engine, table, spec, checkpoint=Checkpoint(path))

    # Rows 1 and 3 failed last time; the others carry marks a regeneration would overwrite.
    crafted = []
    for record in _checkpoint_lines(path):
        if record["row"] in (1, 3):
            record.update(response="", finish_reason="error", completion_tokens=0, error="Generation failed: boom")
        else:
            record.update(response=f"KEPT {record['row']}", prompt_tokens=-1)
        crafted.append(json.dumps(record))
    path.write_text("\n".join(crafted) + "\n", encoding="utf-8")

    plain = run_job(engine, table, spec, checkpoint=Checkpoint(path))
    assert plain.progress.resumed == 4 and plain.failed_rows == [1, 3]
    assert list(plain.table["error"])[1] == "Generation failed: boom"

    retried = run_job(engine, table, JobSpec(params=GREEDY, retry_failed=True), checkpoint=Checkpoint(path))
    assert retried.progress.resumed == 2 and retried.progress.generated_this_run == 2
    out = retried.table
    assert list(out["response"]) == ["KEPT 0", _reference(engine, prompt="beta"), "KEPT 2",
                                     _reference(engine, prompt="delta")]
    assert list(out["prompt_tokens"])[0::2] == [-1, -1]
    assert list(out["error"]) == [""] * 4 and retried.failed_rows == []


def test_cancel_keeps_finished_rows_and_a_rerun_completes(engine, tmp_path):
    prompts = [f"Tell a long story number {i}" for i in range(12)]
    table = pd.DataFrame({"prompt": prompts})
    spec = JobSpec(params=SamplingParams(temperature=0.0, max_new_tokens=200))
    path = tmp_path / "ck.jsonl"
    cancel = threading.Event()
    seen = []

    def on_result(row, generation, record):
        seen.append(row)
        cancel.set()  # stop after the first finished row

    first = run_job(engine, table, spec, checkpoint=Checkpoint(path), on_result=on_result, cancel_event=cancel)
    assert first.cancelled
    finished = {r["row"] for r in _checkpoint_lines(path)}
    assert set(seen) == finished and 1 <= len(finished) < len(prompts)
    assert (first.table["finish_reason"] == "cancelled").sum() == len(prompts) - len(finished)

    rerun = run_job(engine, table, spec, checkpoint=Checkpoint(path))
    assert not rerun.cancelled and rerun.progress.resumed == len(finished)
    assert list(rerun.table["response"]) == [_reference(engine, 200, prompt=p) for p in prompts]


def test_write_failure_is_a_data_error_and_leaves_no_partial_file(tmp_path):
    mixed = pd.DataFrame({"value": [1, "one"], "response": ["a", "b"]})  # Parquet cannot store mixed types
    with pytest.raises(DataError, match="Could not write"):
        write_table(mixed, str(tmp_path / "out.parquet"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="use a file ending in"):
        write_table(mixed, str(tmp_path / "out.xlsx"))


def test_iter_job_streams_partial_tables_and_closing_it_cancels(engine, tmp_path):
    """The app's dataset tab shows the table filling in, and stops the job by closing the iterator."""
    from engine.batch_job import iter_job

    prompts = [f"Short {i}" for i in range(4)]
    table = pd.DataFrame({"prompt": prompts})
    updates, shown = [], []
    for update in iter_job(engine, table, JobSpec(params=GREEDY)):
        updates.append(update)
        shown.append((update.progress.done, update.partial_table()))  # as the app does, on arrival
    assert [u.result is None for u in updates] == [True] * 5 + [False]  # submitted, 4 rows, result
    assert list(shown[0][1]["finish_reason"]) == ["pending"] * 4 and list(shown[0][1]["response"]) == [""] * 4
    assert [done for done, _ in shown] == [0, 1, 2, 3, 4, 4]
    for done, partial in shown:
        assert (partial["finish_reason"] != "pending").sum() == done
    final = updates[-1]
    assert final.partial_table() is final.result.table and not final.result.cancelled
    _assert_ok(final.result.table, [_reference(engine, prompt=p) for p in prompts])

    with pytest.raises(JobError, match="Column 'nope' not found"):
        next(iter_job(engine, table, JobSpec(prompt_column="nope")))

    long_rows = pd.DataFrame({"prompt": [f"A long story {i}" for i in range(8)]})
    path = tmp_path / "ck.jsonl"
    running = iter_job(engine, long_rows, JobSpec(params=SamplingParams(temperature=0.0, max_new_tokens=300)),
                       checkpoint=Checkpoint(path))
    for update in running:
        if update.progress.done:
            partial = update.partial_table()
            break
    running.close()  # what Gradio does when the user stops the event
    finished = [json.loads(line)["row"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert 1 <= len(finished) < len(long_rows)  # closed mid-job
    assert set(partial.index[partial["finish_reason"] != "pending"]) == set(finished)
    assert engine._handles == {}  # the rows in flight were cancelled at once (their KV blocks freed), not left running

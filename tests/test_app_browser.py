"""The real app (tests/conftest.py's `app_server`: `python app.py` on the tiny model) driven in headless Chromium.

Every assertion is about what a user sees in the page: the chat bubble growing, the progress line, the results
table, toasts, the file the Download button gives. The model has random weights, so answers are compared with
the in-process engine's greedy reference (`greedy_reference`, i.e. `model.generate`), never with "good" text.

How the chat text is compared: Gradio's Chatbot sets each bubble's `aria-label` to "<role>'s message: " plus the
message's raw text, so that attribute is the exact string the browser holds (before markdown rendering). The
server passes every message through `inspect.cleandoc` (leading/trailing blank lines and common indentation go)
and the page turns "\\r" into "\\n"; `_as_displayed` applies the same two steps to the reference, nothing else.

Screenshots: `UPDATE_SCREENSHOTS=1 python -m pytest -m browser tests/test_app_browser.py` writes assets/chat.png
and assets/dataset.png; without it they go to the test's tmp_path, so a normal run changes no tracked file.

Needs Debian's Chromium at /usr/bin/chromium (`apt-get install chromium`); Playwright cannot download browsers
here. The module is skipped, with the reason, when it or the playwright package is missing.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import time
from pathlib import Path

import pytest

from tests.conftest import greedy_reference

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ASSETS = Path(__file__).resolve().parent.parent / "assets"
VIEWPORT = {"width": 1280, "height": 900}
TIMEOUT_MS = 30_000

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not Path(CHROMIUM).exists():
    pytest.skip(f"browser tests need Debian's Chromium at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)

expect = sync_api.expect
pytestmark = pytest.mark.browser

# Every assistant bubble's raw text, in order.
_BOT_TEXTS_JS = """() => [...document.querySelectorAll('#chatbot [data-testid="bot"]')]
    .map(el => (el.getAttribute('aria-label') || '').replace(/^bot's message: /, ''))"""
# Records every distinct length the new answer (bubble number `before` + 1) goes through: a MutationObserver sees
# each render, so this is every step the user could see, not a few samples.
_WATCH_JS = """(before) => {
    if (window.__answerObserver) window.__answerObserver.disconnect();
    window.__answerLengths = [];
    const root = document.querySelector('#chatbot');
    const record = () => {
        const bots = root.querySelectorAll('[data-testid="bot"]');
        if (bots.length <= before) return;
        const n = (bots[bots.length - 1].getAttribute('aria-label') || '').replace(/^bot's message: /, '').length;
        const seen = window.__answerLengths;
        if (seen[seen.length - 1] !== n) seen.push(n);
    };
    window.__answerObserver = new MutationObserver(record);
    window.__answerObserver.observe(root, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


# ----------------------------------------------------------------------------------------------------- fixtures --


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser, app_server):
    """A fresh browser context (own cookies, own Gradio session) on the app, per test."""
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    context.set_default_timeout(TIMEOUT_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.goto(app_server)
    expect(opened.locator("#chat-input textarea")).to_be_visible()
    yield opened
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


@pytest.fixture
def shots(tmp_path) -> Path:
    """Where screenshots go: assets/ when UPDATE_SCREENSHOTS=1, else this test's tmp_path."""
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        ASSETS.mkdir(exist_ok=True)
        return ASSETS
    return tmp_path


# ------------------------------------------------------------------------------------------------------ helpers --


def _as_displayed(text: str) -> str:
    """A model answer as the page shows it: exactly (the app sends text blocks, which Gradio does not run through
    inspect.cleandoc), apart from the page's CR -> LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _squeezed(text: str) -> str:
    return " ".join(text.split())


def _chat_reference(engine, messages: list[dict], max_new_tokens: int) -> str:
    """The greedy answer, as text, to the conversation the chat tab sends (thinking switched off)."""
    prompt_ids = engine.prepare(messages=messages, enable_thinking=False, max_new_tokens=max_new_tokens).token_ids
    answer = engine.loaded.tokenizer.decode(greedy_reference(engine, prompt_ids, max_new_tokens),
                                            skip_special_tokens=True)
    assert not answer.lstrip().startswith("<think>"), "this prompt's answer would go to a reasoning bubble"
    return answer


def _row_reference(engine, prompt: str, max_new_tokens: int) -> str:
    prompt_ids = engine.prepare(prompt=prompt, enable_thinking=False, max_new_tokens=max_new_tokens).token_ids
    return engine.loaded.tokenizer.decode(greedy_reference(engine, prompt_ids, max_new_tokens),
                                          skip_special_tokens=True)


def _set_slider(page, elem_id: str, value) -> None:
    """Type into the slider's number box; retried, because a just-opened accordion may not take the first one."""
    box = page.locator(f"#{elem_id} input[type=number]")
    slider = page.locator(f"#{elem_id} input[type=range]")
    for _ in range(20):
        box.fill(str(value))
        box.press("Enter")
        box.blur()
        if slider.input_value() == str(value):
            return
        page.wait_for_timeout(100)
    expect(slider).to_have_value(str(value))


def _settings(page, tab: str, accordion: str, *, temperature=None, max_new_tokens=None) -> None:
    """Open a tab's settings accordion if closed, then set its temperature / max-new-tokens sliders."""
    if not page.locator(f"#{tab}-temperature").is_visible():
        page.locator(f"#{tab}-settings").get_by_text(accordion, exact=True).click()
    if temperature is not None:
        _set_slider(page, f"{tab}-temperature", temperature)
    if max_new_tokens is not None:
        _set_slider(page, f"{tab}-max-tokens", max_new_tokens)


def _chat_settings(page, *, temperature=None, max_new_tokens=None, thinking=None) -> None:
    _settings(page, "chat", "Settings", temperature=temperature, max_new_tokens=max_new_tokens)
    if thinking is not None:
        page.locator("#chat-thinking input").set_checked(thinking)


def _dataset_settings(page, *, temperature=None, max_new_tokens=None) -> None:
    _settings(page, "dataset", "Generation settings", temperature=temperature, max_new_tokens=max_new_tokens)


def _bot_texts(page) -> list[str]:
    return page.evaluate(_BOT_TEXTS_JS)


def _send(page, message: str, *, press_enter: bool = False) -> int:
    """Type a message and send it; returns how many assistant bubbles there were before."""
    before = len(_bot_texts(page))
    page.evaluate(_WATCH_JS, before)
    box = page.locator("#chat-input textarea")
    box.fill(message)
    if press_enter:
        box.press("Enter")
    else:
        page.locator("#chat-send").click()
    expect(box).to_have_value("")  # the message moved into the conversation
    return before


def _wait_for_answer_start(page, before: int, timeout_s: float = 30) -> None:
    page.wait_for_function(f"""() => {{ const b = ({_BOT_TEXTS_JS})(); return b.length > {before} &&
                                       b[b.length - 1].length > 0; }}""", timeout=timeout_s * 1000)


def _wait_for_chat_idle(page, before: int, timeout_s: float = 60) -> str:
    """Wait until the reply event has ended (the chatbot's progress tracker is hidden again); return the answer."""
    _wait_for_answer_start(page, before, timeout_s)
    expect(page.locator("#chatbot > [data-testid=status-tracker]")).to_have_class(re.compile(r"\bhide\b"),
                                                                                  timeout=timeout_s * 1000)
    return _bot_texts(page)[-1]


def _answer_lengths(page) -> list[int]:
    return page.evaluate("() => window.__answerLengths")


def _open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def _upload(page, path: Path) -> None:
    """Upload through the file input, after removing a file shown from an earlier upload (which hides it). After an
    upload Gradio itself refused (too large), the drop zone is back and covers a stale Clear button: no removal."""
    remove = page.locator("#dataset-upload button[aria-label=Clear]")
    if remove.count() and not page.locator("#dataset-upload .upload-container").first.is_visible():
        remove.first.click()
    page.locator("#dataset-upload input[type=file]").set_input_files(str(path))


def _wait_for_job(page, state: str, done: int, total: int, timeout_s: float = 60) -> str:
    progress = page.locator("#dataset-progress")
    expect(progress.locator(".job-state")).to_have_text(state, timeout=timeout_s * 1000)
    expect(progress).to_contain_text(f"{done}/{total} rows")
    return progress.inner_text()


def _table_rows(page, elem_id: str) -> int:
    """Data rows of a gr.Dataframe (its grid's aria-rowcount counts the header row too)."""
    return int(page.locator(f"#{elem_id} [role=grid]").get_attribute("aria-rowcount")) - 1


def _table_cell(page, elem_id: str, row: int, column: str) -> str:
    table = page.locator(f"#{elem_id}")
    headers = [h.get_attribute("title") for h in table.locator("thead th[data-testid^=header-]").all()]
    cell = table.locator(f"[data-testid=cell-{row}-{headers.index(column)}]")
    cell.scroll_into_view_if_needed()
    return cell.inner_text()


def _pick(page, dropdown_id: str, option: str) -> None:
    page.locator(f"#{dropdown_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()
    expect(page.locator(f"#{dropdown_id} input")).to_have_value(option)


def _download(page, tmp_path: Path) -> list[dict]:
    button = page.locator("#dataset-download")
    expect(button).to_be_visible()
    with page.expect_download() as started:
        button.click()
    target = tmp_path / started.value.suggested_filename
    started.value.save_as(target)
    assert target.suffix == ".csv"
    with target.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _toast(page, text: str):
    toast = page.locator(".toast-body", has_text=text)
    expect(toast.first).to_be_visible()
    return toast.first


def _no_traceback(page) -> None:
    body = page.locator("body").inner_text()
    assert "Traceback" not in body and 'File "' not in body, body[-2000:]


def _screenshot(page, path: Path) -> None:
    """A full-page PNG, taken once the engine panel (refreshed every 2 s) shows the finished work's throughput."""
    panel = page.locator("#engine-panel")
    with contextlib.suppress(AssertionError):  # a screenshot with a stale panel is still a screenshot
        expect(panel).to_contain_text(re.compile(r"active 0 · queued 0 · (?!0\.0 )[\d.]+ tok/s"), timeout=5_000)
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


def _write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


# --------------------------------------------------------------------------------------------------------- chat --


def test_chat_streams_and_equals_the_greedy_reference(page, engine, shots):
    _chat_settings(page, temperature=0, max_new_tokens=120, thinking=False)

    first = "Tell me everything about continuous batching."
    before = _send(page, first, press_enter=True)  # the Enter path
    shown = _wait_for_chat_idle(page, before)
    lengths = _answer_lengths(page)
    first_answer = _chat_reference(engine, [{"role": "user", "content": first}], 120)
    assert shown == _as_displayed(first_answer)
    growing = [n for n in lengths if 0 < n < len(shown)]
    assert len(set(growing)) >= 2, f"the answer did not grow in steps: lengths seen {lengths}"

    # A second turn with the Send button: the model sees the conversation exactly as it was written.
    second = "And what about paged attention?"
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": first_answer},
               {"role": "user", "content": second}]
    before = _send(page, second)
    shown = _wait_for_chat_idle(page, before)
    assert len(_bot_texts(page)) == 2
    lengths = _answer_lengths(page)
    assert shown == _as_displayed(_chat_reference(engine, history, 120))
    assert len({n for n in lengths if 0 < n < len(shown)}) >= 2, f"no streaming: lengths seen {lengths}"
    assert not page.locator("#chatbot").get_by_text("Reasoning").count()  # thinking off: no reasoning bubble

    _screenshot(page, shots / "chat.png")


def test_stop_ends_the_answer_and_the_app_stays_usable(page, engine):
    message = "Keep going until I press Stop."
    full = _as_displayed(_chat_reference(engine, [{"role": "user", "content": message}], 900))
    _chat_settings(page, temperature=0, max_new_tokens=900, thinking=False)
    before = _send(page, message)
    _wait_for_answer_start(page, before)
    page.locator("#chat-stop").click()
    stopped = _wait_for_chat_idle(page, before, timeout_s=10)
    time.sleep(1.5)
    assert _bot_texts(page)[-1] == stopped, "the answer kept growing after Stop"
    # Stopped part-way: a prefix of the full greedy answer (compared with whitespace squeezed, because the
    # display trims it; the last two characters may be a character cut in half), and clearly shorter.
    assert 0 < len(stopped) < len(full) * 0.8
    assert _squeezed(full).startswith(_squeezed(stopped)[:-2])

    # The engine request was cancelled, not left running: the engine panel shows no active request.
    expect(page.locator("#engine-panel")).to_contain_text("active 0", timeout=15_000)

    # The app still answers.
    _chat_settings(page, max_new_tokens=16)
    before = _send(page, "Are you still there?")
    assert _wait_for_chat_idle(page, before)
    assert len(_bot_texts(page)) == 2

    # Clear in the middle of an answer empties the conversation for good.
    _chat_settings(page, max_new_tokens=900)
    before = _send(page, message)
    _wait_for_answer_start(page, before)
    page.locator("#chat-clear").click()
    expect(page.locator("#chatbot [data-testid=user]")).to_have_count(0)
    expect(page.locator("#chatbot > [data-testid=status-tracker]")).to_have_class(re.compile(r"\bhide\b"))
    time.sleep(1.0)
    assert _bot_texts(page) == [] and not page.locator("#chatbot [data-testid=user]").count()
    expect(page.locator("#engine-panel")).to_contain_text("active 0", timeout=15_000)


# ------------------------------------------------------------------------------------------------------ dataset --


def test_dataset_upload_run_and_download(page, engine, tmp_path, shots):
    header = ["id", "query", "note"]
    rows = [["1", "Hello, world", "has, comma"], ["2", 'She said "hi"', 'quote " inside'],
            ["3", "Café ☕ 数据 😀", "unicode"], ["4", "", "empty prompt"], ["5", "line one\nline two", "newline"],
            ["6", "007", "leading zeros stay"], ["7", "plain question", ""]]
    source = _write_csv(tmp_path / "questions.csv", header, rows)

    _open_tab(page, "Dataset")
    _upload(page, source)
    status = page.locator("#dataset-status")
    expect(status).to_contain_text("7 rows")
    expect(status).to_contain_text("columns: id, query, note")
    assert _table_rows(page, "dataset-preview") == 7
    assert _table_cell(page, "dataset-preview", 2, "query") == "Café ☕ 数据 😀"
    assert _table_cell(page, "dataset-preview", 1, "query") == 'She said "hi"'
    # No default column name matches, so the first column is preselected; pick the right one.
    expect(page.locator("#prompt-column input")).to_have_value("id")
    _pick(page, "prompt-column", "query")
    _dataset_settings(page, temperature=0, max_new_tokens=12)

    # "Try 5 rows" runs the first five only.
    page.locator("#dataset-try").click()
    _wait_for_job(page, "done", 5, 5)
    assert _table_rows(page, "dataset-results") == 5

    page.locator("#dataset-run").click()
    text = _wait_for_job(page, "done", 7, 7)
    assert "1 failed" in text
    bar = page.locator("#dataset-progress progress")
    assert (bar.get_attribute("value"), bar.get_attribute("max")) == ("7", "7")
    assert _table_rows(page, "dataset-results") == 7
    assert "empty" in _table_cell(page, "dataset-results", 3, "error")
    assert _table_cell(page, "dataset-results", 0, "error") == ""
    _screenshot(page, shots / "dataset.png")

    downloaded = _download(page, tmp_path)
    assert len(downloaded) == 7
    assert list(downloaded[0]) == [*header, "response", "finish_reason", "prompt_tokens", "completion_tokens",
                                   "error"]
    for source_row, out in zip(rows, downloaded, strict=True):
        assert [out[name] for name in header] == source_row  # every input cell as written
    errors = [out for out in downloaded if out["error"]]
    assert len(errors) == 1 and errors[0]["id"] == "4" and errors[0]["response"] == ""
    for source_row, out in zip(rows, downloaded, strict=True):
        if source_row[1]:
            assert out["response"] == _row_reference(engine, source_row[1], 12), out


def test_chat_streams_while_a_dataset_job_runs_then_cancel_keeps_finished_rows(page, engine, tmp_path):
    question = "Is the dataset job slowing me down?"
    greedy = engine.loaded.tokenizer.encode(_chat_reference(engine, [{"role": "user", "content": question}], 48))
    assert len(greedy) > 30, "pick a question whose greedy answer is long enough to watch it stream"
    total = 200
    source = _write_csv(tmp_path / "many.csv", ["prompt"], [[f"Long question number {i}"] for i in range(total)])
    _open_tab(page, "Dataset")
    _upload(page, source)
    expect(page.locator("#dataset-status")).to_contain_text(f"{total} rows")
    expect(page.locator("#prompt-column input")).to_have_value("prompt")
    _dataset_settings(page, max_new_tokens=400)
    page.locator("#dataset-run").click()
    expect(page.locator("#dataset-progress .job-state")).to_have_text("running")

    _open_tab(page, "Chat")
    _chat_settings(page, temperature=0, max_new_tokens=48, thinking=False)
    before = _send(page, question)
    answer = _wait_for_chat_idle(page, before)
    assert answer
    lengths = _answer_lengths(page)
    assert len({n for n in lengths if 0 < n < len(answer)}) >= 2, f"no streaming: lengths seen {lengths}"

    _open_tab(page, "Dataset")
    progress = page.locator("#dataset-progress")
    expect(progress.locator(".job-state")).to_have_text("running")  # the chat finished first
    page.locator("#dataset-cancel").click()
    _toast(page, "Cancelling")
    expect(progress.locator(".job-state")).to_have_text("cancelled, finished rows kept")
    done = int(re.search(rf"(\d+)/{total} rows", progress.inner_text()).group(1))
    assert 0 < done < total

    downloaded = _download(page, tmp_path)
    assert len(downloaded) == total
    finished = [row for row in downloaded if row["finish_reason"] != "cancelled"]
    assert len(finished) == done
    assert all(row["response"] for row in finished)
    assert all(row["response"] == "" for row in downloaded if row["finish_reason"] == "cancelled")
    assert [row["prompt"] for row in downloaded] == [f"Long question number {i}" for i in range(total)]


# -------------------------------------------------------------------------------------------------- bad inputs --


def test_bad_inputs_show_clear_messages_and_the_app_keeps_working(page, tmp_path):
    page.locator("#chat-send").click()  # an empty message
    _toast(page, "Type a message first.")
    page.locator("#chat-regenerate").click()  # nothing to regenerate
    _toast(page, "Nothing to regenerate yet.")
    _send(page, "word " * 3000)  # longer than the tiny model's 1024-token context
    _toast(page, "shorten the prompt")
    expect(page.locator("#chatbot")).to_contain_text("Not answered")
    expect(page.locator("#chatbot")).not_to_contain_text("Error")  # no badge over the conversation
    before = _send(page, "A short question")  # the long message is dropped to fit; this one is answered
    assert _wait_for_chat_idle(page, before)

    _open_tab(page, "Dataset")
    page.locator("#dataset-cancel").click()  # no job running
    _toast(page, "No dataset job is running.")

    page.locator("#dataset-run").click()  # nothing loaded yet
    _toast(page, "Load a dataset first.")
    expect(page.locator("#dataset-progress")).to_contain_text("Load a dataset first.")
    expect(page.locator("#dataset-results")).not_to_contain_text("Error")

    notes = tmp_path / "notes.txt"
    notes.write_text("prompt\nhello\n")
    _upload(page, notes)  # the upload component refuses the type before anything reaches the server
    _toast(page, "Invalid file type: notes.txt")

    garbage = tmp_path / "garbage.csv"
    garbage.write_bytes(bytes(range(128, 256)) * 20)
    _upload(page, garbage)
    _toast(page, "garbage.csv is not UTF-8 text")
    expect(page.locator("#dataset-status")).to_contain_text("garbage.csv is not UTF-8 text")
    for output in ("#dataset-preview", "#dataset-mode", "#prompt-column", "#dataset-template"):
        expect(page.locator(output)).not_to_contain_text("Error")  # no error badge left on the controls

    empty = tmp_path / "empty.csv"
    empty.write_bytes(b"")
    _upload(page, empty)
    _toast(page, "empty.csv is empty")

    big = tmp_path / "big.csv"
    big.write_text("prompt\n" + ("x" * 999 + "\n") * 5300)  # > 5 MB, the server's --max-file-size-mb
    _upload(page, big)
    _toast(page, "exceed the maximum allowed size of 5.0")
    _no_traceback(page)

    # Messages cells that cannot be a conversation: each row gets its error, the good row an answer.
    conversation = '[{"role": "user", "content": "Hi there"}]'
    messages = _write_csv(tmp_path / "chats.csv", ["messages", "tag"],
                          [[conversation, "ok"], ["not json at all", "bad json"],
                           ['[{"role": "robot", "content": "x"}]', "bad role"], ["", "empty"],
                           ['{"role": "user"}', "not a list"]])
    _upload(page, messages)
    expect(page.locator("#dataset-status")).to_contain_text("5 rows")
    expect(page.locator("#dataset-mode input[value='Messages column']")).to_be_checked()
    _dataset_settings(page, temperature=0, max_new_tokens=8)
    page.locator("#dataset-run").click()
    assert "4 failed" in _wait_for_job(page, "done", 5, 5)
    assert _table_cell(page, "dataset-results", 0, "error") == ""
    assert _table_cell(page, "dataset-results", 0, "response")
    assert "not valid JSON" in _table_cell(page, "dataset-results", 1, "error")
    assert "robot" in _table_cell(page, "dataset-results", 2, "error")
    assert "empty" in _table_cell(page, "dataset-results", 3, "error")
    assert _table_cell(page, "dataset-results", 4, "error")

    # A template naming a column that does not exist: refused before anything runs.
    page.locator("#dataset-mode").get_by_text("Template", exact=True).click()
    page.locator("#dataset-template textarea").fill("Answer this: {question}")
    page.locator("#dataset-run").click()
    _toast(page, "Template field(s) {question} are not columns. Columns: messages, tag")
    _no_traceback(page)

    # Still working: a good file loads and runs.
    good = _write_csv(tmp_path / "good.csv", ["prompt"], [["one"], ["two"]])
    _upload(page, good)
    expect(page.locator("#dataset-status")).to_contain_text("2 rows")
    page.locator("#dataset-mode").get_by_text("Prompt column", exact=True).click()
    page.locator("#dataset-try").click()
    _wait_for_job(page, "done", 2, 2)
    assert _table_rows(page, "dataset-results") == 2
    _no_traceback(page)

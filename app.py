"""CB Studio's web app: a Chat tab and a Dataset tab on one shared continuous-batching engine.

This file is only UI: it builds Gradio Blocks around an `Engine` (engine/) and never touches torch. Every browser
session has its own chat history and dataset; all sessions share the one engine, which batches them together.

Run: `python app.py [--model-id ID|PATH|tiny-random] [--host --port --share] [engine flags]`; `--help` lists all,
each also settable by an environment variable (for a Hugging Face Space).
"""

from __future__ import annotations

import argparse
import html
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from engine.config import (
    AppConfig,
    SamplingParams,
    add_app_arguments,
    add_engine_arguments,
    app_config_from_args,
    engine_config_from_args,
)

logger = logging.getLogger("cb_studio.app")

DATASET_SUFFIXES = [".csv", ".tsv", ".jsonl", ".json", ".parquet"]
PREVIEW_ROWS = 10
TABLE_ROWS_SHOWN = 500  # the results table shows this many rows; the download holds them all
UI_REFRESH_S = 0.5
REASONING_TITLE = "💭 Reasoning"
MODES = ["Prompt column", "Messages column", "Template"]
UI_ONLY = {"api_visibility": "undocumented"}  # page events; the API is /chat and /generate_dataset


# ------------------------------------------------------------------------------------------------ shared helpers --


def _text_of(content) -> str:
    """Chatbot message content (a string, a text block, or Gradio 6's list of text blocks) as plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _text_block(text: str) -> dict:
    """Message content as a text block, not a bare string: Gradio's Chatbot runs a string through
    `inspect.cleandoc` (dedenting code, expanding tabs, dropping leading blank lines), and the conversation sent
    back to the model on the next turn would be that altered text. A text block is shown and returned as is."""
    return {"type": "text", "text": text}


def _message_of(error: Exception) -> str:
    return getattr(error, "message", None) or str(error)


def _stop_list(text: str | None) -> tuple[str, ...]:
    """Stop strings from a textbox: one per line (so commas and spaces can be part of one)."""
    return tuple(line for line in (text or "").splitlines() if line)


def _sampling(temperature, top_p, top_k, max_new_tokens, stop_text=None, seed=None) -> SamplingParams:
    """SamplingParams from UI values; invalid values become a gr.Error shown in the page."""

    def number(value, kind):
        return None if value is None or str(value).strip() == "" else kind(value)

    if seed is not None and str(seed).strip() and not str(seed).strip().isdigit():
        raise gr.Error(f"Seed must be a whole number >= 0 (or empty for a random seed), not {seed!r}.")

    try:
        return SamplingParams(temperature=number(temperature, float), top_p=number(top_p, float),
                              top_k=number(top_k, int), max_new_tokens=number(max_new_tokens, int),
                              stop=_stop_list(stop_text), seed=number(seed, int))
    except (TypeError, ValueError) as error:
        raise gr.Error(str(error)) from None


# ------------------------------------------------------------------------------------------------------- chat ----


def history_to_messages(history: list[dict]) -> list[dict]:
    """The conversation for the model: reasoning bubbles are display-only and left out."""
    messages = []
    for message in history or []:
        if (message.get("metadata") or {}).get("title"):
            continue
        messages.append({"role": message["role"], "content": _text_of(message.get("content"))})
    return messages


class _ChatRun:
    """One streaming reply of one session: what Stop and Clear act on."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.cleared = False
        self.stream = None  # the engine's RequestStream once the request is submitted


class ChatHandlers:
    """The chat tab's event functions, bound to the engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def stream_reply(self, history, run, system_prompt, temperature, top_p, top_k, max_new_tokens, stop_text,
                     thinking) -> Iterator[list[dict]]:
        """Stream the assistant's answer to the last user message.

        `run` is the session's gr.State dict: Stop and Clear cancel the engine request through it (see `stop`), so
        this generator ends normally. Gradio's own `cancels=` is not used for that: cancelling a streaming event
        races in Gradio's frontend and can leave the Chatbot covered by an "Error" badge (seen with Gradio 6.31).
        """
        from engine.prompts import PromptError

        current = _ChatRun()
        if isinstance(run, dict):
            run["current"] = current
        messages = history_to_messages(history)
        if not messages or messages[-1]["role"] != "user":
            return
        try:
            params = _sampling(temperature, top_p, top_k, max_new_tokens, stop_text)
            stream = self.engine.stream(messages=messages, system_prompt=system_prompt or None, params=params,
                                        enable_thinking=bool(thinking) if self.engine.supports_thinking else None)
        except (PromptError, gr.Error) as error:
            # A toast and a note in the conversation (display-only: never sent to the model), not gr.Error, whose
            # badge would cover the whole conversation. The message stays; older turns are dropped to fit next time.
            problem = _message_of(error)
            gr.Warning(problem)
            yield [*history, {"role": "assistant", "content": _text_block(problem),
                              "metadata": {"title": "⚠️ Not answered", "status": "done"}}]
            return
        current.stream = stream
        if current.stopped.is_set():  # Stop pressed while the request was being prepared
            stream.cancel()
        history = list(history)
        reasoning: dict | None = None
        answer: dict | None = None
        reasoning_text = answer_text = ""
        started = time.monotonic()
        try:
            for delta in stream:
                if delta.channel == "reasoning":
                    if reasoning is None:
                        reasoning = {"role": "assistant", "content": _text_block(""),
                                     "metadata": {"title": REASONING_TITLE, "status": "pending"}}
                        history.append(reasoning)
                    reasoning_text += delta.text
                    reasoning["content"] = _text_block(reasoning_text)
                else:
                    if answer is None:
                        answer = {"role": "assistant", "content": _text_block("")}
                        history.append(answer)
                    answer_text += delta.text
                    answer["content"] = _text_block(answer_text)
                if current.cleared:
                    break
                yield history
        finally:
            stream.close()  # tab closed (Gradio closes the generator) or Clear: cancel the request, free its blocks
        if current.cleared:
            yield []  # this run's last output, so nothing it streamed earlier can bring the cleared chat back
            return
        result = stream.result
        if reasoning is not None:
            reasoning["metadata"] = {"title": REASONING_TITLE, "status": "done",
                                     "duration": round(time.monotonic() - started, 1)}
        if answer is None:
            answer = {"role": "assistant", "content": _text_block("")}
            history.append(answer)
        if result is not None and result.finish_reason == "error":
            answer["content"] = _text_block(f"{answer_text}\n\n⚠️ {result.error}")
        for notice in result.notices if result is not None else ():
            gr.Info(notice)
        yield history

    @staticmethod
    def stop(run, clear: bool = False) -> None:
        """Stop (or Clear): cancel the session's streaming reply; its generator then ends with what it has."""
        current = (run or {}).get("current")
        if current is None:
            return
        current.cleared = current.cleared or clear
        current.stopped.set()
        if current.stream is not None:
            current.stream.cancel()

    @classmethod
    def clear(cls, run) -> list:
        cls.stop(run, clear=True)
        return []

    @staticmethod
    def add_user_message(message, history):
        # A warning, not gr.Error: an error would cover the whole conversation with Gradio's "Error" badge.
        # stream_reply then finds no new user message (or retries one left unanswered) and ends at once.
        if not (message or "").strip():
            gr.Warning("Type a message first.")
            return gr.update(), gr.update()
        return "", [*(history or []), {"role": "user", "content": _text_block(message)}]

    @staticmethod
    def drop_last_answer(history):
        """For Regenerate: remove the assistant's last answer (and its reasoning) so it is asked again."""
        history = list(history or [])
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            gr.Warning("Nothing to regenerate yet.")  # and stream_reply has nothing to answer
        return history

    def api_chat(self, message: str, system_prompt: str = "", temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None,
                 max_new_tokens: int | None = None) -> Iterator[str]:
        """One chat turn for API clients: yields the reply as it grows (the last value is the full reply)."""
        from engine.prompts import PromptError

        params = _sampling(temperature, top_p, top_k, max_new_tokens)
        try:
            stream = self.engine.stream(prompt=message, system_prompt=system_prompt or None, params=params)
        except PromptError as error:
            raise gr.Error(str(error)) from None
        reply = ""
        try:
            for delta in stream:
                if delta.channel == "answer":
                    reply += delta.text
                    yield reply
        finally:
            stream.close()
        if stream.result is not None and stream.result.finish_reason == "error":
            raise gr.Error(stream.result.error or "generation failed")
        yield reply


# ---------------------------------------------------------------------------------------------------- dataset ----


class DatasetHandlers:
    """The dataset tab's event functions. Per-session state is a dict: {'table': DataFrame, 'result': ...}."""

    def __init__(self, engine, app_config: AppConfig) -> None:
        self.engine = engine
        self.app_config = app_config

    def _limit(self, table):
        limit = self.app_config.max_rows
        if limit is not None and len(table) > limit:
            gr.Warning(f"This app runs at most {limit} rows per job: using the first {limit} of {len(table)}.")
            return table.head(limit)
        return table

    def load(self, upload, hub_id, subset, split, max_rows, state):
        from engine.datasets_io import DataError, read_table

        source = upload if upload else (hub_id or "").strip()
        try:
            if not source:
                raise DataError("Upload a file or type a Hub dataset id first.")
            if upload and Path(upload).suffix.lower() not in DATASET_SUFFIXES:
                raise DataError(f"{Path(upload).name}: unsupported file type; use {', '.join(DATASET_SUFFIXES)}.")
            table = read_table(str(source), subset=(subset or None), split=(split or "train"),
                               max_samples=int(max_rows) if max_rows else None)
        except (DataError, ValueError) as error:
            return self._not_loaded(str(error), state)
        table = self._limit(table)
        columns = list(table.columns)
        state = {"table": table, "result": None, "cancel": None}
        prompt_default = next((c for c in ("prompt", "question", "instruction", "text") if c in columns), columns[0])
        messages_default = "messages" if "messages" in columns else None
        mode = "Messages column" if messages_default else "Prompt column"
        status = f"**{len(table)} rows** · columns: {', '.join(f'`{c}`' for c in columns)}"
        preview = table.head(PREVIEW_ROWS).map(_preview_cell)
        return (state, preview, status, gr.update(choices=columns, value=prompt_default),
                gr.update(choices=columns, value=messages_default or columns[0]), gr.update(value=mode),
                gr.update(placeholder="e.g. " + " ".join("{" + c + "}" for c in columns[:2])))

    @staticmethod
    def _not_loaded(problem: str, state):
        """A dataset that could not be read: a toast and the status line say why; whatever was loaded stays.
        (Not gr.Error: it would leave an "Error" badge on every output until the next successful load.)"""
        gr.Warning(problem)
        kept = " The dataset loaded before is still loaded." if (state or {}).get("table") is not None else ""
        unchanged = gr.update()
        return (unchanged, unchanged, f"⚠️ {problem}{kept}", unchanged, unchanged, unchanged, unchanged)

    def load_hub(self, hub_id, subset, split, max_rows, state):
        return self.load(None, hub_id, subset, split, max_rows, state)

    def run(self, state, mode, prompt_column, messages_column, template, system_prompt, temperature, top_p, top_k,
            max_new_tokens, stop_text, seed, thinking, output_format, sample_rows=None):
        """Run the job (or its first `sample_rows` rows), yielding progress, the filling table and the download."""
        from engine.batch_job import JobError, JobSpec, iter_job

        table = (state or {}).get("table")
        if table is None:
            yield self._not_started("Load a dataset first.")
            return
        if sample_rows:
            table = table.head(sample_rows)
        try:
            params = _sampling(temperature, top_p, top_k, max_new_tokens, stop_text, seed)
            spec = JobSpec(prompt_column=prompt_column if mode == MODES[0] else None,
                           messages_column=messages_column if mode == MODES[1] else None,
                           template=(template or None) if mode == MODES[2] else None,
                           system_prompt=system_prompt or None, params=params,
                           enable_thinking=bool(thinking) if self.engine.supports_thinking else None)
            if mode == MODES[2] and not spec.template:
                raise JobError("Write a template, e.g. 'Summarize: {text}'.")
        except (JobError, ValueError, gr.Error) as error:
            yield self._not_started(_message_of(error))
            return
        cancel = threading.Event()
        state["cancel"] = cancel
        last_shown = 0.0
        try:
            updates = iter_job(self.engine, table, spec, cancel_event=cancel)
            for update in updates:
                now = time.monotonic()
                if update.result is None and now - last_shown < UI_REFRESH_S:
                    continue
                last_shown = now
                shown = update.partial_table().head(TABLE_ROWS_SHOWN)
                yield _progress_html(update.progress, done=update.result is not None), shown, gr.update()
                if update.result is not None:
                    state["result"] = update.result.table
                    yield (_progress_html(update.progress, done=True, cancelled=update.result.cancelled), shown,
                           gr.update(value=_write_download(update.result.table, output_format), visible=True))
        except JobError as error:  # the spec does not fit the table (a missing column): nothing ran
            yield self._not_started(str(error))
        finally:
            state["cancel"] = None

    @staticmethod
    def _not_started(problem: str):
        """Outputs for a job that could not start: a toast and the progress line say why; results stay as they were."""
        gr.Warning(problem)
        return f'<div id="job-progress"><p class="job-problem">⚠️ {html.escape(problem)}</p></div>', gr.update(), gr.update()

    def try_rows(self, *args):
        """"Try 5 rows": the same job on the first five rows, to check the settings before a long run."""
        yield from self.run(*args, sample_rows=5)

    @staticmethod
    def cancel(state):
        event = (state or {}).get("cancel")
        if event is None:
            gr.Info("No dataset job is running.")
            return
        event.set()
        gr.Info("Cancelling: finished rows are kept.")

    @staticmethod
    def change_format(state, output_format):
        table = (state or {}).get("result")
        if table is None:
            return gr.update()
        return gr.update(value=_write_download(table, output_format), visible=True)

    def api_generate(self, rows_jsonl: str, prompt_column: str = "", messages_column: str = "",
                     template: str = "", system_prompt: str = "", temperature: float | None = None,
                     top_p: float | None = None, top_k: int | None = None,
                     max_new_tokens: int | None = None) -> str:
        """Dataset job for API clients: rows as JSON Lines text in, the result as JSON Lines text out."""
        import io

        import pandas as pd

        from engine.batch_job import JobError, JobSpec, run_job

        try:
            table = pd.read_json(io.StringIO(rows_jsonl), lines=True, dtype=False, convert_dates=False)
        except ValueError as error:
            raise gr.Error(f"rows_jsonl is not valid JSON Lines: {error}") from None
        if table.empty:
            raise gr.Error("rows_jsonl holds no rows")
        table = self._limit(table)
        params = _sampling(temperature, top_p, top_k, max_new_tokens)
        try:
            spec = JobSpec(prompt_column=prompt_column or None, messages_column=messages_column or None,
                           template=template or None, system_prompt=system_prompt or None, params=params)
            result = run_job(self.engine, table, spec)
        except (JobError, ValueError) as error:
            raise gr.Error(str(error)) from None
        return result.table.to_json(orient="records", lines=True, force_ascii=False)


def _preview_cell(value):
    text = value if isinstance(value, str) else repr(value) if not isinstance(value, (int, float)) else value
    return text[:200] + "…" if isinstance(text, str) and len(text) > 200 else text


def _progress_html(progress, done: bool = False, cancelled: bool = False) -> str:
    fraction = progress.done / progress.total if progress.total else 1.0
    eta = progress.eta_s
    eta_text = "—" if eta is None else f"{eta:.0f}s"
    state = "cancelled, finished rows kept" if cancelled else "done" if done else "running"
    return (f'<div id="job-progress"><progress value="{progress.done}" max="{progress.total}" '
            f'style="width:100%"></progress>'
            f"<p><b>{progress.done}/{progress.total}</b> rows ({fraction:.0%}) · <b>{progress.failed}</b> failed · "
            f"{progress.resumed} resumed · <b>{progress.tokens_per_second:.1f}</b> tok/s · ETA {eta_text} · "
            f"<span class='job-state'>{state}</span></p></div>")


def _write_download(table, output_format: str) -> str:
    from engine.datasets_io import write_table

    suffix = {"CSV": ".csv", "JSONL": ".jsonl", "Parquet": ".parquet"}[output_format]
    folder = Path(tempfile.mkdtemp(prefix="cb-studio-"))
    return str(write_table(table, str(folder / f"responses{suffix}")))


# ------------------------------------------------------------------------------------------------------ layout ----


def build_app(engine, app_config: AppConfig | None = None) -> gr.Blocks:
    """The whole UI around a started engine."""
    app_config = app_config or AppConfig()
    chat = ChatHandlers(engine)
    data = DatasetHandlers(engine, app_config)
    defaults = engine.default_sampling
    random_note = ("\n\n> ⚠️ **This is `tiny-random`: a model with random weights. Its answers are meaningless "
                   "text; it is here to try the app offline.**") if engine.is_random_model else ""

    with gr.Blocks(title="CB Studio", delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"# CB Studio\nChat and batch generation on transformers' continuous batching: every chat and "
                    f"dataset row shares one engine and one batch.{random_note}")
        with gr.Tab("Chat", id="chat"):
            chatbot = gr.Chatbot(label="Conversation", height=460, elem_id="chatbot", buttons=["copy"])
            with gr.Row():
                message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=5,
                                     elem_id="chat-input", autofocus=True)
                send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop")
            with gr.Row():
                regenerate = gr.Button("Regenerate", size="sm", elem_id="chat-regenerate")
                clear = gr.Button("Clear", size="sm", elem_id="chat-clear")
            with gr.Accordion("Settings", open=False, elem_id="chat-settings"):
                system_prompt = gr.Textbox(label="System prompt", lines=2, placeholder="Optional")
                with gr.Row():
                    temperature = gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05, label="Temperature",
                                            info="0 = greedy", elem_id="chat-temperature")
                    top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
                    top_k = gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k", info="0 = off")
                    max_new_tokens = gr.Slider(1, max(engine.context_tokens - 1, 1),
                                               value=min(defaults.max_new_tokens, engine.context_tokens - 1),
                                               step=1, label="Max new tokens", elem_id="chat-max-tokens")
                with gr.Row():
                    stop_text = gr.Textbox(label="Stop strings", lines=2, placeholder="One per line")
                    thinking = gr.Checkbox(label="Thinking", value=True, interactive=engine.supports_thinking,
                                           elem_id="chat-thinking",
                                           info=None if engine.supports_thinking else
                                           "This model's chat template has no thinking switch")
            chat_settings = [system_prompt, temperature, top_p, top_k, max_new_tokens, stop_text, thinking]
            chat_run = gr.State({})  # this session's streaming reply, for Stop and Clear
            # Gradio's default concurrency of 1 per event would serve chats one at a time: the engine batches them.
            streaming = {"concurrency_limit": app_config.chat_concurrency, **UI_ONLY}
            # Queued (not queue=False): toasts from gr.Warning/gr.Info only reach the page from queued events.
            quick = {"concurrency_limit": None, **UI_ONLY}
            submitted = gr.on([message.submit, send.click], chat.add_user_message, [message, chatbot],
                              [message, chatbot], **quick)
            submitted.then(chat.stream_reply, [chatbot, chat_run, *chat_settings], chatbot, **streaming)
            regenerate.click(chat.drop_last_answer, chatbot, chatbot, **quick).then(
                chat.stream_reply, [chatbot, chat_run, *chat_settings], chatbot, **streaming)
            stop.click(chat.stop, chat_run, None, queue=False, **UI_ONLY)
            clear.click(chat.clear, chat_run, chatbot, queue=False, **UI_ONLY)

        with gr.Tab("Dataset", id="dataset"):
            state = gr.State({})
            with gr.Row():
                upload = gr.File(label="Upload a dataset", file_types=DATASET_SUFFIXES, type="filepath",
                                 elem_id="dataset-upload")
                with gr.Column():
                    hub_id = gr.Textbox(label="…or a Hub dataset id", placeholder="owner/name")
                    with gr.Row():
                        subset = gr.Textbox(label="Subset", placeholder="default")
                        split = gr.Textbox(label="Split", value="train")
                        # An empty gr.Number reaches the server as 0 (never None): 0 means "all rows".
                        max_rows = gr.Number(label="Max rows", value=0, precision=0, minimum=0, info="0 = all")
                    load = gr.Button("Load from the Hub")
            status = gr.Markdown("Upload a CSV, TSV, JSONL or Parquet file, or name a Hub dataset.",
                                 elem_id="dataset-status")
            preview = gr.Dataframe(label="Preview", interactive=False, elem_id="dataset-preview", max_height=300)
            with gr.Row():
                mode = gr.Radio(MODES, value=MODES[0], label="Generate from", elem_id="dataset-mode")
                prompt_column = gr.Dropdown(label="Prompt column", choices=[], elem_id="prompt-column")
                messages_column = gr.Dropdown(label="Messages column", choices=[], elem_id="messages-column")
                template = gr.Textbox(label="Template", placeholder="e.g. Summarize: {text}", elem_id="dataset-template")
            with gr.Accordion("Generation settings", open=False, elem_id="dataset-settings"):
                data_system = gr.Textbox(label="System prompt", lines=2)
                with gr.Row():
                    data_temperature = gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05,
                                                 label="Temperature", info="0 = greedy",
                                                 elem_id="dataset-temperature")
                    data_top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
                    data_top_k = gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k")
                    data_max_tokens = gr.Slider(1, max(engine.context_tokens - 1, 1),
                                                value=min(defaults.max_new_tokens, engine.context_tokens - 1), step=1,
                                                label="Max new tokens", elem_id="dataset-max-tokens")
                with gr.Row():
                    data_stop = gr.Textbox(label="Stop strings", lines=1, placeholder="One per line")
                    # A textbox, not gr.Number: an empty Number would send 0 and seed every job with 0.
                    data_seed = gr.Textbox(label="Seed", placeholder="random", max_lines=1)
                    data_thinking = gr.Checkbox(label="Thinking", value=False, interactive=engine.supports_thinking)
            with gr.Row():
                try_rows = gr.Button("Try 5 rows", elem_id="dataset-try")
                run = gr.Button("Run", variant="primary", elem_id="dataset-run")
                cancel = gr.Button("Cancel", variant="stop", elem_id="dataset-cancel")
                output_format = gr.Radio(["CSV", "JSONL", "Parquet"], value="CSV", label="Download as")
            progress = gr.HTML(elem_id="dataset-progress")
            results = gr.Dataframe(label="Results", interactive=False, elem_id="dataset-results", max_height=420,
                                   wrap=True)
            download = gr.DownloadButton("Download results", visible=False, elem_id="dataset-download")

            loaded_outputs = [state, preview, status, prompt_column, messages_column, mode, template]
            upload.upload(data.load, [upload, hub_id, subset, split, max_rows, state], loaded_outputs, **UI_ONLY)
            load.click(data.load_hub, [hub_id, subset, split, max_rows, state], loaded_outputs, **UI_ONLY)
            job_inputs = [state, mode, prompt_column, messages_column, template, data_system, data_temperature,
                          data_top_p, data_top_k, data_max_tokens, data_stop, data_seed, data_thinking,
                          output_format]
            job_outputs = [progress, results, download]
            run.click(data.run, job_inputs, job_outputs, concurrency_limit=None, **UI_ONLY)
            try_rows.click(data.try_rows, job_inputs, job_outputs, concurrency_limit=None, **UI_ONLY)
            # Queued (gr.Info toasts only reach the page from queued events), and never waiting behind a job.
            cancel.click(data.cancel, state, None, concurrency_limit=None, **UI_ONLY)
            output_format.change(data.change_format, [state, output_format], download, **UI_ONLY)

        with gr.Accordion("Engine", open=True):
            panel = gr.Markdown(engine.stats().as_markdown(), elem_id="engine-panel")
            gr.Timer(2.0).tick(lambda: engine.stats().as_markdown(), None, panel, queue=False, **UI_ONLY)

        gr.api(chat.api_chat, api_name="chat", concurrency_limit=app_config.chat_concurrency)
        gr.api(data.api_generate, api_name="generate_dataset", concurrency_limit=None)
    return demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python app.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_arguments(parser)
    add_app_arguments(parser)
    try:
        args = parser.parse_args(argv)
        engine_config, app_config = engine_config_from_args(args), app_config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)

    from engine.engine import get_engine
    from engine.loader import ModelLoadError

    try:
        engine = get_engine(engine_config)
    except (ModelLoadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    demo = build_app(engine, app_config)
    demo.queue(default_concurrency_limit=None)
    try:
        demo.launch(server_name=app_config.host, server_port=app_config.port, share=app_config.share,
                    max_file_size=int(app_config.max_file_size_mb * 1024 * 1024), footer_links=["api", "settings"])
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

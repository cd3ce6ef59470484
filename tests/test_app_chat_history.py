"""The conversation the model sees on the next turn is exactly what was typed and answered.

A Chatbot's value makes a round trip through the browser: `postprocess` on the way out, `preprocess` on the way
back, both Gradio's own code, used here as is. Plain string content would come back through `inspect.cleandoc`
(code dedented, tabs expanded, blank lines dropped); the app's text blocks must come back unchanged.
"""

from __future__ import annotations

import gradio as gr

from engine.config import SamplingParams


def _through_the_browser(history: list[dict]) -> list[dict]:
    chatbot = gr.Chatbot()
    return chatbot.preprocess(chatbot.postprocess(history))


def test_code_typed_and_answered_reaches_the_model_unchanged(engine):
    import app

    chat = app.ChatHandlers(engine)
    typed = "Fix this:\n\tif x:\n\t\treturn 1\n\n"  # tabs, indentation and a trailing blank line
    _, history = chat.add_user_message(typed, [])
    history = _through_the_browser(history)
    assert app.history_to_messages(history) == [{"role": "user", "content": typed}]

    replies = list(chat.stream_reply(history, {}, "", 0.0, 1.0, 0, 12, "", False))
    history = _through_the_browser(replies[-1])
    messages = app.history_to_messages(history)

    thinking = False if engine.supports_thinking else None
    expected = engine.generate(messages=[{"role": "user", "content": typed}], enable_thinking=thinking,
                               params=SamplingParams(temperature=0.0, max_new_tokens=12)).text
    assert messages == [{"role": "user", "content": typed}, {"role": "assistant", "content": expected}]

    # What plain strings would have become: the reason for the text blocks.
    plain = _through_the_browser([{"role": "user", "content": typed}])
    assert app.history_to_messages(plain)[0]["content"] != typed

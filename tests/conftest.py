"""Shared fixtures: tiny random models (real architectures, real tokenizer and chat template) and started engines.

The models are built once per test session by the same builder `--model-id tiny-random` uses, saved with
`save_pretrained` and loaded through `from_pretrained`. Their weights are random: tests compare the engine with
`model.generate` on the same weights, never with "good" answers.
"""

from __future__ import annotations

import logging
import os

import pytest

from engine.config import EngineConfig

# No test needs the Hub; without this an unreachable Hub costs ~45 s of retries per lookup.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """A private cache folder for built tiny models, shared with app/CLI subprocesses via CB_STUDIO_CACHE."""
    folder = tmp_path_factory.mktemp("cb-studio-cache")
    previous = os.environ.get("CB_STUDIO_CACHE")
    os.environ["CB_STUDIO_CACHE"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("CB_STUDIO_CACHE", None)
    else:
        os.environ["CB_STUDIO_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny_model_path(model_cache) -> str:
    from engine.tiny_model import build_tiny_model

    return str(build_tiny_model(architecture="qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_path(model_cache) -> str:
    from engine.tiny_model import build_tiny_model

    return str(build_tiny_model(architecture="llama"))


def _start_engine(path: str, **overrides):
    from engine.engine import Engine

    return Engine(EngineConfig(model_id=path, device="cpu", **overrides)).start()


@pytest.fixture(scope="session")
def engine(tiny_model_path):
    """One started engine on the tiny Qwen2 model, shared by the session (like the app shares one)."""
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    started = _start_engine(tiny_model_path)
    yield started
    started.shutdown()


@pytest.fixture(scope="session")
def llama_engine(tiny_llama_path):
    started = _start_engine(tiny_llama_path)
    yield started
    started.shutdown()


@pytest.fixture(scope="session")
def start_engine():
    """Start extra engines with other settings; they are shut down at the end of the session."""
    started = []

    def start(path: str, **overrides):
        new = _start_engine(path, **overrides)
        started.append(new)
        return new

    yield start
    for running in started:
        running.shutdown()


def greedy_reference(engine, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """What `model.generate` gives greedily for these prompt ids, end-of-turn token included if reached."""
    import torch

    model = engine.loaded.model
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=engine._eos_ids, pad_token_id=engine._eos_ids[-1])
    return output[0, len(prompt_ids):].tolist()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def app_server(tiny_model_path, tmp_path_factory):
    """`python app.py` for real, on the tiny model, on a free localhost port. Yields its URL."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port()
    log_path = tmp_path_factory.mktemp("app") / "app.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "app.py", "--model-id", tiny_model_path, "--device", "cpu", "--port", str(port),
         "--max-rows", "500", "--max-file-size-mb", "5"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"})
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the app did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    yield url
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()

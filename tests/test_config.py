"""Configuration: validation messages, flags and environment variables in one place, quick --help."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig, SamplingParams, add_engine_arguments, engine_config_from_args


def _parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, environ=environ or {})
    return engine_config_from_args(parser.parse_args(argv))


def test_flags_build_the_config():
    config = _parse(["--model-id", "tiny-random", "--dtype", "bfloat16", "--max-batch-tokens", "256",
                     "--kv-cache-gib", "2", "--attn-implementation", "sdpa", "--cuda-graph", "off"])
    assert config == EngineConfig(model_id="tiny-random", dtype="bfloat16", max_batch_tokens=256, kv_cache_gib=2.0,
                                  attn_implementation="sdpa", use_cuda_graph=False)


def test_environment_sets_defaults_and_flags_win():
    environ = {"MODEL_ID": "env-model", "MAX_BATCH_TOKENS": "128", "TRUST_REMOTE_CODE": "1"}
    assert _parse([], environ) == EngineConfig(model_id="env-model", max_batch_tokens=128, trust_remote_code=True)
    assert _parse(["--model-id", "flag-model"], environ).model_id == "flag-model"


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="MAX_BATCH_TOKENS"):
        _parse([], {"MAX_BATCH_TOKENS": "lots"})


@pytest.mark.parametrize("changes,needle", [
    ({"device": "tpu"}, "device"), ({"dtype": "int4"}, "dtype"), ({"max_batch_tokens": 3}, "max_batch_tokens"),
    ({"kv_cache_gib": -1.0}, "kv_cache_gib"), ({"model_id": " "}, "model_id"), ({"page_size": 1}, "page_size"),
])
def test_invalid_engine_config(changes, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**changes)


def test_sampling_error_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"temperature=-1.0 is not valid: must be in \[0.0, 10.0\]"):
        SamplingParams(temperature=-1.0)


def test_stop_strings_are_normalised():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", ""]).stop == ("a",)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[1, 2])


_HELP_PROBE = """
import runpy, sys
sys.argv = [{target!r}, "--help"]
try:
    runpy.{runner}({target!r}, run_name="__main__")
except SystemExit:
    pass
print("TORCH_LOADED" if "torch" in sys.modules else "TORCH_NOT_LOADED")
"""


@pytest.mark.parametrize("runner,target", [("run_path", "app.py"), ("run_module", "engine.cli")])
def test_help_answers_without_loading_a_model(runner, target):
    probe = _HELP_PROBE.format(runner=runner, target=target)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--model-id" in result.stdout and "--max-batch-tokens" in result.stdout
    assert "TORCH_NOT_LOADED" in result.stdout  # no torch, no model: --help is instant


def test_app_without_the_model_exits_with_advice_not_a_traceback(model_cache):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "app.py", "--model-id", "no-such-org/no-such-model", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "--model-id tiny-random" in result.stderr and "--model-id PATH" in result.stderr
    assert "Traceback" not in result.stderr

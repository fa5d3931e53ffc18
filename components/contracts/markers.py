"""The chat format every trace and trajectory is written in: special-token markers and the three segment kinds.

    <|user|>{question}<|assistant|>                         prompt         action_mask 0
    {text}<|python|>{code}<|/python|>                        assistant turn action_mask 1
    <|output|>{stdout}<|/output|>                            tool turn      action_mask 0 (observation)
    {text}\\boxed{answer}<|end|>                             final turn     action_mask 1

The tokenizer (components/models/tokenizer.py) makes each marker one special token, so a tool call ends on a
single stop token.
"""

from __future__ import annotations

PAD = "<|pad|>"
UNK = "<|unk|>"
END = "<|end|>"
"""End of the episode's final assistant turn (EOS)."""
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
CALL = "<|python|>"
"""Opens a Python tool call written by the model."""
CALL_END = "<|/python|>"
"""Closes a tool call: the engine stops here and the environment runs the code."""
OUTPUT = "<|output|>"
"""Opens the tool output (an observation, written by the environment)."""
OUTPUT_END = "<|/output|>"

SPECIAL_TOKENS = (PAD, UNK, END, USER, ASSISTANT, CALL, CALL_END, OUTPUT, OUTPUT_END)
"""In this order they take token ids 0..8."""


def prompt_text(question: str) -> str:
    """The prompt an episode starts from."""
    return f"{USER}{question}{ASSISTANT}"


def observation_text(output: str) -> str:
    """The tokens the environment appends after a tool call."""
    return f"{OUTPUT}{output}{OUTPUT_END}"


def tool_call_text(content: str, code: str) -> str:
    """An assistant turn that ends in a tool call."""
    return f"{content}{CALL}{code}{CALL_END}"


def answer_text(content: str) -> str:
    """An assistant turn that ends the episode."""
    return f"{content}{END}"

"""Policy and critic construction, attention freezing, chunked token log-probs, the tokenizers and a model
directory's chat format."""

from components.models.freeze import freeze_attention, is_attention_module
from components.models.logprobs import token_logprobs
from components.models.policy import (
    build_policy,
    init_model_dir,
    load_policy,
    save_model_dir,
)
from components.models.tokenizer import (
    build_tokenizer,
    config_tokenizer,
    load_chat,
    load_tokenizer,
    start_chat,
    start_tokenizer,
)
from components.models.value import ValueModel

__all__ = [
    "ValueModel",
    "build_policy",
    "build_tokenizer",
    "config_tokenizer",
    "freeze_attention",
    "init_model_dir",
    "is_attention_module",
    "load_chat",
    "load_policy",
    "load_tokenizer",
    "save_model_dir",
    "start_chat",
    "start_tokenizer",
    "token_logprobs",
]

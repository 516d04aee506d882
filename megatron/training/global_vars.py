"""The run's validated arguments and tokenizer, reachable from model providers and forward steps.

Megatron's entry points read `get_args()` / `get_tokenizer()` instead of threading them through
every call; `pretrain` sets both before it calls any user function. Light (no megatron-core).
"""
from __future__ import annotations

import argparse
from typing import Optional

from megatron.training.tokenizer import AnyTokenizer, build_tokenizer

_ARGS: Optional[argparse.Namespace] = None
_TOKENIZER: Optional[AnyTokenizer] = None


def set_global_variables(args: argparse.Namespace) -> None:
    """Install validated `args` and the tokenizer they name (replacing a previous run's)."""
    global _ARGS, _TOKENIZER
    _ARGS = args
    _TOKENIZER = build_tokenizer(args)


def get_args() -> argparse.Namespace:
    if _ARGS is None:
        raise RuntimeError("get_args() before pretrain() set the arguments")
    return _ARGS


def get_tokenizer() -> AnyTokenizer:
    if _TOKENIZER is None:
        raise RuntimeError("get_tokenizer() before pretrain() set the arguments")
    return _TOKENIZER

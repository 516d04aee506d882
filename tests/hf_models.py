"""Tiny random-weight Hugging Face models of the three families, made here (nothing downloaded).

Each folder is what `save_pretrained` writes (config.json, model.safetensors) plus a tokenizer.json
built with the `tokenizers` library and a tokenizer_config.json naming its end-of-text token. The
weights are drawn with a large std (0.2) and the norms' weights away from 1, so a misplaced head,
a wrong RoPE frequency or a swapped gate shows in the logits.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB = 96          # the model's rows; the tokenizer has fewer ids (as Qwen2's and Llama 3's)
TOKENIZER_VOCAB = 90
EOS = "</s>"
_WORDS = ("the red fox sees a small cat near the old barn while rain falls on green hills "
          "and quiet rivers run past stone bridges under a grey sky").split()


def _configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, initializer_range=0.2, max_position_embeddings=64,
                  attention_dropout=0.0)
    return {
        "llama": LlamaConfig(**{**common, "max_position_embeddings": 16384}, num_key_value_heads=2, rope_theta=500000.0,
                             rms_norm_eps=1e-5, rope_scaling={
                                 "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}),
        "mistral": MistralConfig(**common, num_key_value_heads=2, sliding_window=64,
                                 rope_theta=20000.0),
        "qwen2": Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True,
                             rope_theta=1000000.0),
    }


FAMILIES = ("llama", "mistral", "qwen2")


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of TOKENIZER_VOCAB ids (EOS and an unknown token included)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(_WORDS))
    vocab = {EOS: 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    for i in range(len(vocab), TOKENIZER_VOCAB):
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}))


def make_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Save a tiny random `family` model with its tokenizer into `folder`; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[family], dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


def corpus_lines(count: int, seed: int = 0) -> list[str]:
    """`count` JSON lines of text in the tokenizer's words."""
    import random

    rng = random.Random(seed)
    return [json.dumps({"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 60)))})
            for _ in range(count)]

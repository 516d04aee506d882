"""Hugging Face checkpoints in and out: Llama, Mistral and Qwen2 folders (config.json +
safetensors) as megatron-core GPT models with Seq1F1B's span layer spec.

config.py reads config.json into the model's shape and Megatron-LM's flags, weights.py maps the
tensors, folder.py reads and writes the Hugging Face folder, checkpoint.py writes and reads the
megatron checkpoint. tools/checkpoint/convert.py and tools/hf_parity.py are the command lines;
the parity check (megatron.training.hf_parity) lives with the trainer, whose loader it tests.
"""


class ConversionError(ValueError):
    """Bad input to a conversion: one line naming the file or flag; nothing has been written."""

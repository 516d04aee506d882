"""Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.16.1), flag for flag, at a
tiny shape: the same flags in the same order, the sizes shrunk (layers, widths, vocabulary,
batch, samples, paths). `GPU_ONLY` are the flags only a GPU (with Transformer Engine) honours:
the diff a user needs on the CPU, shown in the README."""

FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
       "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]


def script_flags(folder: str) -> list[str]:
    """The script's flags (its mock-data variant) with `folder` for checkpoints, cache and logs."""
    return [
        "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64",
        "--ffn-hidden-size", "224", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
        "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
        "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "16",
        "--lr-decay-samples", "15", "--lr-warmup-samples", "4", "--lr", "0.00015",
        "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        *FP8,
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "1",
        "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--data-cache-path", f"{folder}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
        "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "2",
        "--profile-step-end", "3", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60", "--save", f"{folder}/checkpoints",
        "--load", f"{folder}/checkpoints", "--tensorboard-dir", f"{folder}/tensorboard",
    ]


REFUSED_AT_PARSE = ["--apply-layernorm-1p", "--fp8-format", "--fp8-amax-history-len",
                    "--fp8-amax-compute-algo", "--fp8-param-gather"]
"""Refused in one line as the flags are parsed (Transformer Engine / FP8)."""
REFUSED_AT_VALIDATION = ["--attention-backend", "fused"]
"""TE's fused attention, refused without a GPU (validation); on a CPU --attention-backend auto."""


def cpu_flags(folder: str, attention_backend: str = "auto") -> list[str]:
    """The script's flags less the GPU-only ones (the README's diff), and seq1f1b with k=2."""
    flags = script_flags(folder)
    for fp8 in (FP8[i:i + 2] for i in range(0, 6, 2)):
        at = flags.index(fp8[0])
        del flags[at:at + 2]
    flags.remove("--fp8-param-gather")
    flags.remove("--apply-layernorm-1p")
    at = flags.index("--attention-backend")
    flags[at + 1] = attention_backend
    return flags + ["--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2"]

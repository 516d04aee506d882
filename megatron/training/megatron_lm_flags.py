"""Every flag of Megatron-LM's arguments.py (core_v0.16.1) and what it does here.

A Megatron-LM user's command line runs unchanged, or stops in one line saying why. Each upstream
flag (the list in megatron_lm_flags.tsv, extracted once from Megatron-LM's parser) has one status:

- honoured: pretrain_gpt.py's parser defines it, with Megatron-LM's name, default and meaning
  (megatron/training/arguments.py);
- no-op: accepted and ignored, because what it changes upstream is already so here or does not
  exist here (a kernel fusion the CPU path never uses, DataLoader workers this harness has not);
  `NO_OPS` gives the reason of each;
- refused: the parse stops with one line naming every refused flag given and why (`REFUSED`
  for single flags, `REFUSED_PREFIXES` for families such as --moe-*, `REFUSED_GROUPS` for whole
  upstream argument groups, and a group's own reason otherwise).

`add_upstream_flags(parser)` registers the flags the parser lacks with these statuses, so a flag
honoured later needs nothing here: a defined flag is honoured by construction. `python -m
megatron.training.megatron_lm_flags` prints the table.
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

UPSTREAM_FILE = Path(__file__).with_name("megatron_lm_flags.tsv")
REFUSED_KEY = "_megatron_lm_refused"


@dataclass(frozen=True)
class UpstreamFlag:
    """One flag of Megatron-LM's parser: its argument group, its option strings, its arity."""

    group: str
    options: tuple[str, ...]
    arity: str          # "0" for a switch, else argparse's nargs ("1" for one value)

    @property
    def name(self) -> str:
        return self.options[0]


@functools.lru_cache(maxsize=1)
def upstream_flags() -> tuple[UpstreamFlag, ...]:
    """The flags of megatron_lm_flags.tsv, in Megatron-LM's order."""
    flags = []
    for line in UPSTREAM_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            group, options, arity = line.split("\t")
            flags.append(UpstreamFlag(group, tuple(options.split()), arity))
    return tuple(flags)


_FUSION = "a kernel fusion: megatron-core's fused kernels are not used here, the unfused path " \
          "computes the same"
_PERF = "performance only upstream (memory or scheduling); nothing to change here"
_TE = "needs Transformer Engine on a GPU (not supported: the layers are megatron-core's local ones)"
_FP8 = "FP8/FP4 training needs Transformer Engine on a Hopper-class GPU (not supported)"
_NVIDIA = "NVIDIA's resiliency and telemetry services are not available here"

NO_OPS: dict[str, str] = {
    "--use-mcore-models": "megatron-core's models are the only ones here (the upstream default)",
    "--no-rope-fusion": _FUSION, "--no-masked-softmax-fusion": _FUSION,
    "--no-bias-swiglu-fusion": _FUSION, "--no-bias-dropout-fusion": _FUSION,
    "--no-bias-gelu-fusion": _FUSION, "--no-persist-layer-norm": _FUSION,
    "--disable-jit-fuser": _FUSION, "--no-gradient-reduce-div-fusion": _FUSION,
    "--cross-entropy-loss-fusion": "the span loss computes the same cross entropy unfused",
    "--cross-entropy-fusion-impl": "the span loss computes the same cross entropy unfused",
    "--attention-softmax-in-fp32": "the span attention's softmax is computed in fp32 already",
    "--no-create-attention-mask-in-dataloader": "the [s, s] mask is never created here (causal "
                                                "attention needs none)",
    "--num-workers": "micro-batches are read in the training process (no DataLoader workers)",
    "--dataloader-type": "micro-batches follow Megatron's pretraining sampler order (single)",
    "--no-pin-cpu-grads": _PERF,
    "--no-pin-cpu-params": _PERF, "--high-priority-stream-groups": _PERF,
    "--use-cpu-initialization": "parameters are initialised on the CPU whenever there is no GPU",
    "--tiktoken-pattern": "read only by --tokenizer-type TikTokenizer (not available here)",
    "--tiktoken-num-special-tokens": "read only by --tokenizer-type TikTokenizer",
    "--tiktoken-special-tokens": "read only by --tokenizer-type TikTokenizer",
    "--distributed-backend": "NCCL on GPUs, gloo on the CPU, chosen by the device",
    "--local-rank": "read from torchrun's LOCAL_RANK",
    "--no-async-tensor-model-parallel-allreduce": _PERF,
    "--no-ckpt-fully-parallel-save": "every rank writes its own shards (megatron-core's default)",
    "--ckpt-fully-parallel-save": "every rank writes its own shards (megatron-core's default)",
    "--ckpt-fully-parallel-load": _PERF, "--ckpt-assume-constant-structure": _PERF,
    "--use-dist-ckpt": "deprecated upstream: checkpoints are torch_dist (dist_checkpointing)",
    "--no-one-logger": _NVIDIA, "--disable-msc": "the multi-storage client is not used here",
    "--logging-level": "Python logging levels are left as they are",
    "--no-clone-scatter-output-in-embedding": _PERF, "--no-align-grad-reduce": _PERF,
    "--no-overlap-p2p-communication": "p2p is issued as the plan's communication groups "
                                      "(performance only upstream)",
    "--overlap-p2p-communication-warmup-flush": _PERF, "--no-scatter-gather-tensors-in-pipeline":
        _PERF,
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated and reduced in fp32 "
                                            "already (unless --grad-reduce-in-bf16)",
}
"""Flags accepted without effect, and why nothing changes."""

REFUSED: dict[str, str] = {
    "--apply-layernorm-1p": "zero-centred gamma is TE's (megatron-core's torch norm refuses it)",
    "--use-flash-attn": "deprecated upstream; use --attention-backend flash",
    "--fp8-param-gather": _FP8, "--te-precision-config-file": _TE, "--te-rng-tracker": _TE,
    "--tp-comm-overlap-cfg": _TE, "--use-te-activation-func": _TE,
    "--use-legacy-models": "the legacy (pre-megatron-core) models are not available",
    "--checkpoint-activations": "removed upstream; use --recompute-granularity",
    "--batch-size": "removed upstream; use --micro-batch-size",
    "--warmup": "removed upstream; use --lr-warmup-iters or --lr-warmup-samples",
    "--model-parallel-size": "removed upstream; use --tensor-model-parallel-size",
    "--rampup-batch-size": "batch-size ramp-up is not implemented: the micro-batch count (the "
                           "pipeline plan) is fixed for the run",
    "--optimizer": "only Adam is built (megatron-core's Adam or distributed optimizer)",
    "--encoder-num-layers": "encoder-decoder models are not supported (GPT only)",
    "--decoder-num-layers": "encoder-decoder models are not supported (GPT only)",
    "--encoder-seq-length": "encoder-decoder models are not supported; use --seq-length",
    "--decoder-seq-length": "encoder-decoder models are not supported; use --seq-length",
    "--use-rotary-position-embeddings": "deprecated upstream; use --position-embedding-type rope",
    "--no-position-embedding": "deprecated upstream; use --position-embedding-type none",
    "--train-data-path": "per-split data paths are not implemented; use --data-path and --split",
    "--valid-data-path": "per-split data paths are not implemented; use --data-path and --split",
    "--test-data-path": "per-split data paths are not implemented; use --data-path and --split",
    "--deterministic-mode": "not implemented (the CPU runs are deterministic; on a GPU, "
                            "megatron-core's deterministic kernels are TE's)",
    "--padded-vocab-size": "derived from the tokenizer, --make-vocab-size-divisible-by and TP "
                           "(or kept from the checkpoint), as Megatron-LM derives it",
    "--microbatch-group-size-per-virtual-pipeline-stage": "the interleaved plans group "
                                                          "micro-batches by the pipeline size",
    "--account-for-embedding-in-pipeline-split": "give every stage's layers with "
                                                 "--pipeline-model-parallel-layout",
    "--account-for-loss-in-pipeline-split": "give every stage's layers with "
                                            "--pipeline-model-parallel-layout",
    "--num-virtual-stages-per-pipeline-rank": "use --num-layers-per-virtual-pipeline-stage",
    "--apply-query-key-layer-scaling": "fp16 attention scaling of megatron's fused softmax is "
                                       "not used (the span softmax runs in fp32)",
    "--rotary-interleaved": "interleaved RoPE is not supported by the span positions",
    "--fp16-lm-cross-entropy": "the span loss computes the cross entropy in fp32",
    # transformer configuration
    "--pipeline-model-parallel-comm-backend": "pipeline p2p runs on the process group's backend "
                                              "(NCCL or gloo); a separate backend is not wired",
    "--hierarchical-context-parallel-sizes": "hierarchical CP is for --cp-comm-type a2a+p2p; "
                                             "the span attention's CP is Ulysses a2a",
    "--max-seqlen-per-dp-cp-rank": "dynamic context parallelism (packed sequences across DP x "
                                   "CP) is not supported",
    "--no-initialization": "skipping weight initialisation is not wired (a checkpoint loaded "
                           "with --load overwrites the initial weights anyway)",
    "--overlap-moe-expert-parallel-comm": "mixture of experts is not supported (dense GPT only)",
    "--delay-wgrad-compute": "megatron-core's MoE/A2A weight-gradient delay; the split-backward "
                             "schedules (--pipeline-schedule seq1f1b-zb-*) defer W instead",
    "--ep-overlap-early-attn-memory-release": "expert-parallel overlap: mixture of experts is "
                                              "not supported",
    "--use-ring-exchange-p2p": "needs a custom PyTorch build with ring exchange; p2p is the "
                               "plan's batched isend/irecv groups",
    "--defer-embedding-wgrad-compute": "needs TE's gradient-accumulation fusion on the output "
                                       "layer; the zero-bubble schedules defer W per span",
    "--wgrad-deferral-limit": "belongs to --defer-embedding-wgrad-compute (not supported)",
    "--cpu-offloading-num-layers": "activation CPU offloading is not supported (use "
                                   "--recompute-granularity)",
    "--softmax-type": "only the vanilla softmax is implemented by the span attention (no "
                      "off-by-one or learnable sink)",
    "--fp32-residual-connection": "an fp32 residual stream is not wired into the span layers",
    "--apply-residual-connection-post-layernorm": "the post-LN residual variant is not wired "
                                                  "(pre-LN GPT only)",
    "--glu-linear-offset": "the offset GLU variant is not wired into the MLP (plain --swiglu)",
    "--activation-func-clamp-value": "clamped activations are not wired into the MLP",
    "--attention-output-gate": "gated attention output is not implemented by the span attention",
    "--multi-latent-attention": "multi-latent attention is not supported by the span attention",
    "--experimental-attention-variant": "experimental attention variants are not supported",
    "--embedding-init-method-std": "a separate embedding init std is not wired; "
                                   "--init-method-std applies to every weight",
    "--init-model-with-meta-device": "meta-device initialisation is an FSDP feature (FSDP is "
                                     "not supported)",
    "--disable-bf16-reduced-precision-matmul": "not wired: torch's default for reduced-precision "
                                               "bf16 reductions is kept",
    "--use-fused-weighted-squared-relu": "the weighted squared ReLU is a MoE activation (not "
                                         "supported)",
    "--distribute-saved-activations": "recompute's TP-distributed checkpoints are not wired; "
                                      "use --recompute-granularity without it",
    "--recompute-modules": "selective recompute of named modules is not wired; use "
                           "--recompute-granularity selective (core attention) or full",
    "--config-logger-dir": "megatron-core's per-module config dumps are not wired",
    "--flash-decode": "an inference kernel (inference is not part of this harness)",
    "--batch-invariant-mode": "batch-invariant kernels are TE/GPU kernels (not supported)",
    "--symmetric-ar-type": "symmetric-memory all-reduce needs NCCL/NVLS on GPUs (not wired)",
    "--mrope-section": "multimodal RoPE is for vision-language models (not supported)",
    "--disable-mamba-mem-eff-path": "Mamba / hybrid models are not supported",
    "--mlp-chunks-for-prefill": "an inference option (inference is not part of this harness)",
    "--fine-grained-activation-offloading": "activation offloading is not supported",
    "--min-offloaded-tensor-size": "activation offloading is not supported",
    # network size
    "--window-size": "sliding-window attention is not implemented by the span attention",
    "--window-attn-skip-freq": "sliding-window attention is not implemented by the span attention",
    "--relative-attention-num-buckets": "relative position buckets are T5's (encoder-decoder "
                                        "is not supported)",
    "--relative-attention-max-distance": "relative position buckets are T5's (encoder-decoder "
                                         "is not supported)",
    "--no-rope-freq": "per-layer NoPE/RoPE mixes are not supported by the span positions",
    "--openai-gelu": "legacy-model GELU approximation; megatron-core models use torch's GELU",
    "--squared-relu": "not wired into the MLP: use the default GELU or --swiglu",
    "--quick-geglu": "not wired into the MLP: use the default GELU or --swiglu",
    "--onnx-safe": "ONNX export is not part of this harness",
    "--bert-no-binary-head": "BERT models are not supported (GPT only)",
    # regularization
    "--apply-wd-to-qk-layernorm": "QK layernorm is not supported by the span attention",
    "--no-weight-decay-cond-type": "custom no-weight-decay conditions are not wired (biases and "
                                   "norms get none, megatron's default)",
    # training
    "--decrease-batch-size-if-needed": "the batch size (and with it the pipeline plan) is fixed "
                                       "for the run",
    "--check-weight-hash-across-dp-replicas-interval": "the replica weight-hash check is not "
                                                       "wired (--check-for-nan-in-loss-and-grad "
                                                       "is)",
    "--train-sync-interval": "a GPU host-sync throttle; the CPU path has nothing to throttle",
    "--exit-signal-handler-for-dataloader": "no DataLoader workers here (micro-batches are read "
                                            "in the training process)",
    "--iterations-to-skip": "skipping listed iterations is not implemented",
    "--check-for-large-grads": "megatron's rerun machine is not used (NaN checks stop the run)",
    "--result-rejected-tracker-filename": "megatron's rerun machine is not used",
    "--disable-gloo-process-groups": "gloo groups are needed: the CPU path runs on them",
    "--rope-type": "only megatron-core's rope is wired into the span positions (no YaRN)",
    "--use-torch-optimizer-for-cpu-offload": "optimizer CPU offload is not supported",
    "--overlap-cpu-optimizer-d2h-h2d": "optimizer CPU offload is not supported",
    "--dump-param-to-param-group-map": "not wired (a debugging dump of the optimizer's groups)",
    # RNG and initialization
    "--data-parallel-random-init": "every DP rank starts from the same weights (megatron's "
                                   "default); per-rank initialisation is not wired",
    "--init-method-xavier-uniform": "not wired: weights are normal(0, --init-method-std)",
    # learning rate and weight decay
    "--lr-wsd-decay-style": "the WSD schedule is not wired (--lr-decay-style linear, cosine, "
                            "inverse-square-root or constant)",
    "--lr-wsd-decay-iters": "the WSD schedule is not wired",
    "--lr-wsd-decay-samples": "the WSD schedule is not wired",
    "--start-weight-decay": "weight-decay increments are not wired: use --weight-decay "
                            "(constant)",
    "--end-weight-decay": "weight-decay increments are not wired: use --weight-decay (constant)",
    "--weight-decay-incr-style": "weight-decay increments are not wired: --weight-decay is "
                                 "constant",
    # checkpointing
    "--save-wgrads-interval": "gradient dumps are not implemented",
    "--save-dgrads-interval": "gradient dumps are not implemented",
    "--save-retain-interval": "old checkpoints are kept, none is deleted (checkpoint "
                              "retention is not implemented)",
    "--load-main-params-from-ckpt": "the fp32 main parameters are rebuilt from the loaded "
                                    "weights; loading them separately is not wired",
    "--ckpt-step": "the tracker's newest checkpoint is loaded; loading a given step is not "
                   "implemented",
    "--use-mp-args-from-checkpoint-args": "use --use-checkpoint-args (the model flags); the "
                                          "parallel layout comes from the flags and reshards",
    "--no-use-tokenizer-model-from-checkpoint-args": "the tokenizer is always the flags' "
                                                     "(checkpoint args are not read for it)",
    "--auto-detect-ckpt-format": "only torch_dist is read (--ckpt-format torch_dist)",
    "--use-persistent-ckpt-worker": "megatron-core's persistent worker is a spawned process "
                                    "that needs a CUDA device and is not wired; --async-save "
                                    "uses its forked writer",
    "--no-strict-fsdp-dtensor-load": "the fsdp_dtensor format is not supported (FSDP is not)",
    "--dist-ckpt-strictness": "loads are strict: every key must match (megatron-core's "
                              "assume_ok_unexpected is not exposed)",
    "--dist-ckpt-save-pre-mcore-014": "checkpoints are saved in megatron-core 0.16's layout "
                                      "only",
    "--distrib-optim-fully-reshardable-mem-efficient": "not wired: "
                                                       "--dist-ckpt-optim-fully-reshardable "
                                                       "gathers over DP as megatron's default",
    "--dist-ckpt-format": "deprecated upstream; use --ckpt-format torch_dist",
    # mixed precision
    "--reuse-grad-buf-for-mxfp8-param-ag": _FP8,
    # distributed
    "--distributed-timeout-seconds-after-init": "one timeout for the whole run: use "
                                                "--distributed-timeout-minutes",
    "--overlap-param-gather-with-optimizer-step": "not wired: --overlap-param-gather overlaps "
                                                  "the gather with the next forward",
    "--lazy-mpu-init": "for external callers that set up megatron's groups themselves (not "
                       "this entry point)",
    "--use-nccl-ub": "NCCL user buffers (GPU, FSDP) are not wired",
    "--disable-symmetric-registration": "NCCL symmetric registration (GPU, FSDP) is not wired",
    "--use-sharp": "SHARP in-network reduction is an NCCL/InfiniBand setting (not wired)",
    "--sharp-enabled-group": "SHARP in-network reduction is not wired",
    "--create-all-gather-group": "a separate all-gather group for overlap is not wired",
    "--data-parallel-sharding-strategy": "an FSDP option (FSDP is not supported; use "
                                         "--use-distributed-optimizer)",
    "--outer-dp-sharding-strategy": "an HSDP option (FSDP is not supported)",
    "--suggested-communication-unit-size": "an FSDP option (FSDP is not supported)",
    "--keep-fp8-transpose-cache": "an FSDP FP8 option (neither is supported)",
    "--enable-full-sharding-in-hsdp": "an HSDP option (FSDP is not supported)",
    "--num-distributed-optimizer-instances": "one distributed optimizer instance over all of DP "
                                             "(multiple instances are not wired)",
    "--use-tp-pp-dp-mapping": "ranks are ordered TP-CP-DP-PP, megatron's default (the other "
                              "order is not wired)",
    "--fake-process-group": "a benchmarking shortcut without communication; not wired",
    # validation
    "--test-mode": "megatron's in-run self-tests are not part of this harness",
    "--full-validation": "evaluation is --eval-iters global batches (a full pass is not "
                         "implemented)",
    "--multiple-validation-sets": "one validation split (from --split) is supported",
    # data and dataloader
    "--phase-transition-iterations": "data phases are not implemented (one --data-path blend "
                                     "for the run)",
    "--data-args-path": "give the blend with --data-path (reading it from a file is not "
                        "implemented)",
    "--per-split-data-args-path": "per-split data paths are not implemented; use --data-path "
                                  "and --split",
    "--per-dataset-sequences-path": "not wired: the index files give the sequence counts",
    "--dataloader-fast-cache-load": "not wired: the dataset cache is built or read as usual",
    "--dataloader-defer-npy-index-mmap": "not wired: index files are mapped when built",
    "--sample-rate": "an audio/multimodal data option (not supported)",
    "--mask-prob": "a BERT/T5 masking option (GPT only)",
    "--short-seq-prob": "a BERT/T5 data option (GPT only)",
    "--num-dataset-builder-threads": "datasets are built by one thread per rank (not exposed)",
    "--object-storage-cache-path": "object storage (the multi-storage client) is not used here",
    "--mid-level-dataset-surplus": "not wired: megatron-core's blend surplus default is used",
    "--allow-ambiguous-pad-tokens": "no padding tokens are used (fixed-length GPT samples)",
    # tokenizer
    "--vocab-extra-ids": "extra sentinel ids are T5's (GPT only)",
    "--tokenizer-metadata": "megatron's new tokenizer library is not used; give --tokenizer-type",
    "--tokenizer-special-tokens": "not wired: the tokenizer's own special tokens are used",
    "--legacy-tokenizer": "the tokenizers here are the legacy ones already",
    "--tokenizer-sentencepiece-legacy": "SentencePiece's legacy flag is not wired",
    "--tokenizer-hf-use-fast": "not wired: HuggingFace's default (fast when available) is used",
    "--tokenizer-hf-include-special-tokens": "not wired: HuggingFace's default encoding is used",
    "--trust-remote-code": "remote tokenizer code is never run here",
    # logging
    "--log-progress": "progress.txt (job throughput and tokens per checkpoint) is not written",
    "--log-memory-interval": "not wired: every log line has the peak memory per stage",
    "--log-device-memory-used": "nvidia-smi readings are not logged (GPU only)",
    "--log-max-attention-logit": "the span attention does not track its maximum logit",
    "--wandb-entity": "not wired: W&B uses the logged-in default entity",
    "--log-energy": "GPU energy readings are not logged",
    # experimental
    "--enable-experimental": "megatron-core's experimental features are not enabled here",
    "--spec": "the layer spec is the span layer spec (seq1f1b.megatron_adapter); custom specs "
              "are not loaded",
    "--yaml-cfg": "flags are read from the command line only (YAML configs are not read)",
    "--use-precision-aware-optimizer": "TE's precision-aware Adam is not available (torch's "
                                       "Adam or megatron's distributed optimizer)",
    "--main-grads-dtype": "belongs to --use-precision-aware-optimizer (main grads are fp32)",
    "--main-params-dtype": "belongs to --use-precision-aware-optimizer (main params are fp32)",
    "--exp-avg-dtype": "belongs to --use-precision-aware-optimizer (Adam moments are fp32)",
    "--exp-avg-sq-dtype": "belongs to --use-precision-aware-optimizer (Adam moments are fp32)",
}
"""Single flags refused, and why."""


REFUSED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("--fp8", _FP8), ("--fp4", _FP8), ("--no-fp8", _FP8), ("--first-last-layers-bf16", _FP8),
    ("--num-layers-at-", _FP8), ("--kitchen", _FP8), ("--use-kitchen", _FP8),
    ("--moe", "mixture of experts is not supported (dense GPT only)"),
    ("--num-experts", "mixture of experts is not supported (dense GPT only)"),
    ("--expert-", "mixture of experts is not supported (dense GPT only)"),
    ("--mtp-", "multi-token prediction is not supported"),
    ("--mamba", "Mamba / hybrid models are not supported"),
    ("--hybrid-", "Mamba / hybrid models are not supported"),
    ("--is-hybrid-model", "Mamba / hybrid models are not supported"),
    ("--tp-comm", "TP communication overlap needs Transformer Engine's userbuffers"),
    ("--no-tp-comm", "TP communication overlap needs Transformer Engine's userbuffers"),
    ("--cuda-graph", "CUDA graphs are not supported (the span schedule is dynamic Python)"),
    ("--enable-cuda-graph", "CUDA graphs are not supported (the span schedule is dynamic Python)"),
    ("--external-cuda-graph", "CUDA graphs are not supported"),
    ("--fsdp", "FSDP is not supported; use --use-distributed-optimizer"),
    ("--use-megatron-fsdp", "FSDP is not supported; use --use-distributed-optimizer"),
    ("--use-torch-fsdp2", "FSDP is not supported; use --use-distributed-optimizer"),
    ("--torch-fsdp2", "FSDP is not supported; use --use-distributed-optimizer"),
    ("--non-persistent", "non-persistent (local) checkpoints are not supported"),
    ("--muon", "only Adam is built"), ("--sgd", "only Adam is built"),
    ("--dsa-", "experimental attention variants are not supported"),
    ("--linear-", "experimental attention variants are not supported"),
    ("--qk-", "QK normalisation / clipping is not supported by the span attention"),
    ("--inference", "inference and serving are not part of this training harness"),
    ("--fim-", "fill-in-the-middle data is not supported"),
    ("--nccl-", "NCCL tuning options are not exposed"),
    ("--ddp-", "megatron DDP's bucket tuning is not exposed (its defaults are used)"),
    ("--optimizer-", "optimizer CPU offload is not supported"),
    ("--offload", "activation offloading is not supported"),
    ("--ckpt-convert", "checkpoint format conversion: use tools/checkpoint/convert.py"),
    ("--replication", "checkpoint replication is not supported"),
)
"""Families of flags refused for one reason (matched by prefix, in order)."""

REFUSED_GROUPS: dict[str, str] = {
    "Transformer-Engine": _TE, "inference": "inference and serving are not part of this "
                                           "training harness",
    "rl": "reinforcement learning is not part of this harness",
    "sft": "supervised fine-tuning datasets are not supported (pretraining data only)",
    "biencoder": "biencoder / retrieval models are not supported", "vision": "vision models "
                                                                           "are not supported",
    "moe": "mixture of experts is not supported (dense GPT only)",
    "mla": "multi-latent attention is not supported by the span attention",
    "experimental_attention_variant": "experimental attention variants are not supported",
    "heterogeneous architecture": "heterogeneous layer configurations are not supported",
    "In-process restart": _NVIDIA, "ft_package": _NVIDIA, "straggler": _NVIDIA,
    "one logger": _NVIDIA, "workload inspector": _NVIDIA, "msc": _NVIDIA,
    "autoresume": "ADLR autoresume is not available; use --exit-signal-handler with Slurm",
    "rerun engine": "megatron's rerun state machine is not used (NaN checks stop the run)",
}
"""Whole upstream argument groups refused for one reason."""


def status(flag: UpstreamFlag, defined: frozenset[str]) -> tuple[str, str]:
    """("honoured", "") when the parser defines one of `flag`'s option strings, else ("no-op" or
    "refused", the reason)."""
    if any(option in defined for option in flag.options):
        return "honoured", ""
    if flag.name in NO_OPS:
        return "no-op", NO_OPS[flag.name]
    if flag.name in REFUSED:
        return "refused", REFUSED[flag.name]
    for prefix, reason in REFUSED_PREFIXES:
        if flag.name.startswith(prefix):
            return "refused", reason
    if flag.group in REFUSED_GROUPS:
        return "refused", REFUSED_GROUPS[flag.group]
    return "refused", f"not implemented here (Megatron-LM's {flag.group} options)"


NO_OP_VALUES: dict[str, tuple[str, ...]] = {
    "--dataloader-type": ("single",),
    "--distributed-backend": ("nccl", "gloo"),
}
"""No-op flags whose other values mean something not done here (upstream's cyclic and external
data loaders, a backend that does not exist): those values are refused, not ignored."""


class _NoOp(argparse.Action):
    """Accept the flag (and its values) and keep what was given under its name; a value
    `NO_OP_VALUES` does not list is noted as a refusal."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        allowed = NO_OP_VALUES.get(self.option_strings[0])
        if allowed is not None and values not in allowed:
            found = dict(getattr(namespace, REFUSED_KEY, None) or {})
            found[f"{option_string} {values}"] = f"only {' or '.join(allowed)} runs here"
            setattr(namespace, REFUSED_KEY, found)
            return
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


class _Refused(argparse.Action):
    """Note the flag and why; `refusals` reports all of them in one line after the parse."""

    def __init__(self, *args, reason: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        found = dict(getattr(namespace, REFUSED_KEY, None) or {})
        found[option_string] = self.reason
        setattr(namespace, REFUSED_KEY, found)


def _nargs(arity: str):
    """argparse's nargs of a table arity: "0" a switch, "1" one value, a count ("3") that many
    values (an int: argparse multiplies by it), "+"/"*"/"?" as they are."""
    if arity == "0":
        return 0
    if arity == "1":
        return None
    return int(arity) if arity.isdigit() else arity


def add_upstream_flags(parser: argparse.ArgumentParser) -> None:
    """Register every upstream flag `parser` does not define, as a no-op or a refusal (hidden
    from --help: `python -m megatron.training.megatron_lm_flags` lists them)."""
    defined = frozenset(parser._option_string_actions)
    group = parser.add_argument_group("Megatron-LM flags without effect here, or refused")
    for flag in upstream_flags():
        kind, reason = status(flag, defined)
        if kind == "honoured":
            _add_aliases(parser, flag)
            continue
        dest = flag.name.lstrip("-").replace("-", "_")
        action = dict(action=_NoOp) if kind == "no-op" else dict(action=_Refused, reason=reason)
        # no default: an absent flag leaves no attribute, so getattr(args, name, default)
        # elsewhere (a checkpoint's Megatron-LM args, say) keeps meaning "not given"
        group.add_argument(*flag.options, dest=dest, nargs=_nargs(flag.arity),
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS, **action)


def _add_aliases(parser: argparse.ArgumentParser, flag: UpstreamFlag) -> None:
    """Megatron-LM's other spellings of a flag the parser defines under one of them (e.g.
    --persistent-save-interval for --save-interval) go to the same action."""
    action = next(parser._option_string_actions[o] for o in flag.options
                  if o in parser._option_string_actions)
    for option in flag.options:
        if option not in parser._option_string_actions:
            action.option_strings.append(option)
            parser._option_string_actions[option] = action


def refusals(args: argparse.Namespace) -> Optional[str]:
    """The one line naming every refused Megatron-LM flag given and why, or None; removes the
    record from `args`."""
    found = vars(args).pop(REFUSED_KEY, None)
    if not found:
        return None
    by_reason: dict[str, list[str]] = {}
    for option, reason in found.items():
        by_reason.setdefault(reason, []).append(option)
    return "Megatron-LM flags not supported here: " + "; ".join(
        f"{' '.join(options)} ({reason})" for reason, options in by_reason.items())


def main() -> int:
    """Print the table: flag, status, reason (honoured flags are pretrain_gpt.py --help's)."""
    from megatron.training.arguments import build_parser

    parser = build_parser()
    honoured = frozenset(option for option, action in parser._option_string_actions.items()
                         if not isinstance(action, (_NoOp, _Refused)))
    for flag in upstream_flags():
        kind, reason = status(flag, honoured)
        print(f"{flag.name}\t{kind}\t{reason}")
    return 0


if __name__ == "__main__":    # through the imported module: its classes are the parser's
    from megatron.training import megatron_lm_flags

    sys.exit(megatron_lm_flags.main())

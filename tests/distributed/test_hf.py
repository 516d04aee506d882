"""Hugging Face models through the whole path, on 4 CPU processes (one torchrun launch):

- parity: Llama (GQA, Llama 3 RoPE scaling), Mistral and Qwen2 (QKV bias, tied embeddings),
  converted and run at TP2 x PP2 with seq1f1b k=3, give transformers' logits and loss (fp32,
  megatron.training.hf_parity's threshold); Llama also with seq1f1b-interleaved at V=2, k=2;
- training: the converter's printed flags resume its release checkpoint in pretrain_gpt.py at
  TP2 x PP2 (bf16, data preprocessed with --tokenizer-model <the HF folder>) as iteration 0 with a
  fresh optimizer; at --lr 0 the checkpoint it saves, exported with megatron-to-hf, holds the
  original weights rounded to bf16 (every shard was loaded where it belongs, and the bf16 run's
  fp32 main parameters followed the loaded weights).
"""
import json
import shlex
import subprocess
import sys

import pytest
import torch

from launch import ROOT, run_cases

sys.path.insert(0, str(ROOT / "tests"))
from hf_models import FAMILIES, corpus_lines, make_model  # noqa: E402

WORLD = 4


def _tool(*argv) -> str:
    proc = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                         "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {family: make_model(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}
    (root / "corpus.jsonl").write_text("\n".join(corpus_lines(200)) + "\n")
    _tool(ROOT / "tools" / "preprocess_data.py", "--input", root / "corpus.jsonl",
          "--output-prefix", root / "corpus", "--append-eod", "--tokenizer-type",
          "HuggingFaceTokenizer", "--tokenizer-model", models["llama"])
    printed = _tool(ROOT / "tools" / "checkpoint" / "convert.py", "hf-to-megatron", "--hf-dir",
                    models["llama"], "--save", root / "ckpt", "--tp", 2, "--pp", 2)
    flags = shlex.split(next(line for line in printed.splitlines() if line.startswith("  --")))
    training = flags + [
        "--save", str(root / "ckpt"), "--data-path", str(root / "corpus_text_document"),
        "--split", "100,0,0", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "0", "--bf16",
        "--pipeline-schedule", "seq1f1b", "--seq1f1b-splits", "2", "--log-interval", "1"]
    cases = [{"parity": {"hf_dir": str(models[family]), "tp": 2, "pp": 2, "splits": 3}}
             for family in FAMILIES] + [{"argv": training}, {"parity": {
                 "hf_dir": str(models["llama"]), "tp": 2, "pp": 2, "vpp": 2, "splits": 2,
                 "schedule": "seq1f1b-interleaved"}}]
    out = run_cases(WORLD, "hf_worker.py", cases)
    for case, result in zip(cases, out):
        assert "error" not in result, f"{case}: {result.get('traceback', result.get('error'))}"
    print("seconds per case:", [r["seconds"] for r in out])
    _tool(ROOT / "tools" / "checkpoint" / "convert.py", "megatron-to-hf", "--load",
          root / "ckpt", "--save", root / "trained")
    return {"parity": dict(zip(FAMILIES, out)), "training": out[3], "interleaved": out[4],
            "root": root, "models": models}


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_transformers_at_tp2_pp2_k3(results, family):
    result = results["parity"][family]
    print(f"{family}: max_abs_logit_diff {result['max_abs_logit_diff']:.3e} (largest |logit| "
          f"{result['max_abs_logit']:.3g}), loss {result['loss']:.7f} vs {result['hf_loss']:.7f}")
    assert result["passed"]
    assert result["max_abs_logit_diff"] <= 1e-4 * max(1.0, result["max_abs_logit"])
    assert result["loss"] == pytest.approx(result["hf_loss"], rel=1e-5)
    assert result["case"]["tp"] == 2 and result["case"]["pp"] == 2 \
        and result["case"]["splits"] == 3


def test_parity_interleaved_at_tp2_pp2_v2(results):
    result = results["interleaved"]
    print(f"llama, seq1f1b-interleaved V=2 k=2: max_abs_logit_diff "
          f"{result['max_abs_logit_diff']:.3e}")
    assert result["passed"] and result["case"]["vpp"] == 2


def test_release_checkpoint_resumes_at_iteration_0_and_keeps_the_weights(results):
    training, root = results["training"], results["root"]
    assert training["start_iteration"] == 0 and training["iteration"] == 2
    assert [r["iteration"] for r in training["history"]] == [1, 2]
    assert all(r["losses"]["lm loss"] > 0 for r in training["history"])
    assert (root / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    original, trained = _tensors(results["models"]["llama"]), _tensors(root / "trained")
    assert sorted(original) == sorted(trained)
    for name, tensor in original.items():
        assert torch.equal(trained[name], tensor.bfloat16().float()), name
    assert json.loads((root / "trained" / "config.json").read_text()) == \
        json.loads((results["models"]["llama"] / "config.json").read_text())

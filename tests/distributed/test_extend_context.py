"""examples/extend_context.sh end to end on a tiny generated Llama (GQA, SwiGLU, RMSNorm, Llama 3
RoPE scaling; nothing downloaded): convert, tokenize with the folder's tokenizer, continue
training at 4x a 32-token context with a raised RoPE base under seq1f1b k=4 at PP 2, export, and
load the export with transformers (the script's last step checks it)."""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT, _free_port

sys.path.insert(0, str(ROOT / "tests"))
from hf_models import corpus_lines, make_model  # noqa: E402


def test_extend_context_converts_trains_longer_and_exports(tmp_path):
    folder = make_model("llama", tmp_path / "llama")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(corpus_lines(200)) + "\n")
    out = tmp_path / "run"
    env = {**os.environ, "PY": sys.executable, "HF_DIR": str(folder), "DATA": str(corpus),
           "OUT": str(out), "BASE_LENGTH": "32", "TP": "1", "PP": "2", "SPLITS": "4",
           "TRAIN_ITERS": "4", "GLOBAL_BATCH": "2", "LR": "1e-3",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "extend_context.sh")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train at 128 tokens (4 x 32), RoPE base 2000000, seq1f1b k=4" in proc.stdout
    log = (out / "train.log").read_text()
    assert log.count("lm loss:") >= 4 and "iteration        4/       4" in log
    config = json.loads((out / "hf" / "config.json").read_text())
    # the checkpoint's RoPE base; its 128 tokens are shorter than config.json's 16384, kept
    assert (config["rope_theta"], config["max_position_embeddings"]) == (2000000.0, 16384)
    assert "transformers loads" in proc.stdout


def test_extend_context_refuses_a_missing_folder_in_one_line(tmp_path):
    env = {**os.environ, "HF_DIR": str(tmp_path / "nothing"), "DATA": str(tmp_path / "x"),
           "OUT": str(tmp_path / "run")}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "extend_context.sh")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config.json does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["quickstart.sh", "extend_context.sh"])
def test_an_out_folder_the_scripts_did_not_make_is_refused_untouched(tmp_path, script):
    folder = make_model("llama", tmp_path / "llama")
    (tmp_path / "corpus.jsonl").write_text("{}\n")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    env = {**os.environ, "HF_DIR": str(folder), "DATA": str(tmp_path / "corpus.jsonl"),
           "OUT": str(out), "PY": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "examples" / script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"{script}: error: OUT={out} exists and was not made by an " \
        f"example script (no .seq1f1b-example-output in it): choose another OUT, or empty it " \
        f"yourself"
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_an_out_folder_an_example_made_is_emptied_and_marked_again(tmp_path):
    out = tmp_path / "run"
    prepare = f"source examples/out_folder.sh && prepare_out {out} x.sh"
    for _ in range(2):
        subprocess.run(["bash", "-c", prepare], cwd=ROOT, check=True, timeout=30)
        (out / "old.log").write_text("from the last run")
    subprocess.run(["bash", "-c", prepare], cwd=ROOT, check=True, timeout=30)
    assert sorted(p.name for p in out.iterdir()) == [".seq1f1b-example-output"]

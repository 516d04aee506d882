"""Pipeline communication that cannot finish fails after --p2p-timeout, naming the ranks and the
messages: a receive whose sender never sends, and the runtime's old prefetch order, which gloo's
NCCL-order stream runs into the deadlock NCCL would."""
import time

from launch import run_cases

TIMEOUT_S = 3


def test_stuck_pipelines_fail_within_the_timeout_naming_ranks_and_messages():
    start = time.time()
    silent, prefetch = run_cases(2, "p2p_timeout_worker.py",
                                 [{"kind": "silent", "timeout_s": TIMEOUT_S},
                                  {"kind": "prefetch", "timeout_s": TIMEOUT_S}], timeout_s=180)
    error = silent[1]["error"]
    assert error.startswith("pipeline rank 1: F0.0 waited more than 3 s for its p2p group 0 ")
    assert "recv activation of micro-batch 0 span 0 for stage 1 from pipeline rank 0" in error
    assert error.endswith("(--p2p-timeout)")
    for rank, result in enumerate(prefetch):
        error = result["error"]
        assert error is not None and error.startswith(f"pipeline rank {rank}: "), error
        assert "waited more than 3 s" in error and "from pipeline rank" in error
        assert result["seconds"] < 4 * TIMEOUT_S
    assert "recv gradient of micro-batch 0 span 0 for stage 0 from pipeline rank 1" in \
        prefetch[0]["error"]
    assert "recv activation of micro-batch 1 span 0 for stage 1 from pipeline rank 0" in \
        prefetch[1]["error"]
    assert time.time() - start < 150

"""A receive whose sender never sends fails after --p2p-timeout, naming rank, action and peer."""
import time

from launch import run_cases


def test_missing_message_fails_with_rank_action_and_peer():
    start = time.time()
    (result,) = run_cases(2, "p2p_timeout_worker.py", [{"timeout_s": 2}], timeout_s=120)
    assert result["error"] is not None
    assert "pipeline rank 1" in result["error"]
    assert "F0.0" in result["error"] and "from pipeline rank 0" in result["error"]
    assert "waited more than 2 s" in result["error"] and "--p2p-timeout" in result["error"]
    assert time.time() - start < 100

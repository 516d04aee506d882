"""`decoder_seq_length` is the p2p tensor length of the non-interleaved schedules, as in
megatron-core 0.16.1's 1F1B: at k=1 ours trains a stage-0-lengthens-the-sequence toy exactly as
megatron's own function does; at k=2 it is refused with a line naming the argument."""
from launch import run_cases

SCHEDULES = ["1f1b", "seq1f1b"]


def test_decoder_seq_length_is_the_p2p_length_as_in_megatrons_1f1b():
    ranks = run_cases(2, "decoder_length_worker.py", [{"schedules": SCHEDULES}], timeout_s=300)
    for rank in ranks:
        *runs, refusal = rank["results"]
        assert [run["schedule"] for run in runs] == SCHEDULES
        assert all(run["grads_equal"] for run in runs), rank
        assert refusal["refusal_at_k2"].startswith(
            "decoder_seq_length=5 differs from seq_length=3"), refusal
    for run in ranks[1]["results"][:-1]:            # the last stage reports the losses
        assert len(run["losses"]) == 3 and run["losses"] == run["megatron_losses"], run

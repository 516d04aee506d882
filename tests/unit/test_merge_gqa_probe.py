"""device_check's merge_gqa probe on the CPU: the merge and today's GQA path both match the fp32
reference, and a merge that is a few percent off is reported out of bounds."""
from seq1f1b.device_checks import merge_gqa


class _Open:
    @staticmethod
    def passed() -> bool:
        return False


def test_the_probe_finds_both_paths_exact_in_fp32():
    result = merge_gqa.check_merge_gqa(64, 8, 16, _Open())
    assert (result["heads"], result["kv_heads"], result["span"]) == (8, 2, 16)
    for path in ("merged", "lower_right"):
        assert all(error < 1e-5 for error in result[path]["errors"].values()), result[path]
    assert result["within_bound"] is True


def test_a_merge_a_few_percent_off_is_out_of_bounds(monkeypatch):
    merged = merge_gqa._merged
    monkeypatch.setattr(merge_gqa, "_merged", lambda *args: merged(*args) * 1.05)
    assert merge_gqa.check_merge_gqa(64, 8, 16, _Open())["within_bound"] is False

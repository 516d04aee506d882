"""The numerics part of device_check --suite gpu can fail: a span path that loses part of its
cached prefix, or rounds worse than bf16 allows, is out of bounds."""
import pytest

from seq1f1b.device_checks import numerics as device_numerics

pytestmark = pytest.mark.usefixtures("megatron_world")


class _Open:
    @staticmethod
    def passed() -> bool:
        return False


def _sdpa(monkeypatch, corrupt=None) -> dict:
    monkeypatch.setattr(device_numerics, "NUMERICS_BACKENDS", ("sdpa",))
    if corrupt is not None:
        span_path = device_numerics._span_path

        def corrupted(*args, **kwargs):
            return {name: corrupt(name, value)
                    for name, value in span_path(*args, **kwargs).items()}

        monkeypatch.setattr(device_numerics, "_span_path", corrupted)
    return device_numerics.check_numerics(128, 2, 16, 1e9, _Open())["backends"]["sdpa"]


def test_the_span_path_is_within_bf16_bounds(monkeypatch):
    entry = _sdpa(monkeypatch)
    assert entry["within_bound"], entry
    assert all(0 < error < 2 ** -6 for error in entry["span_errors"].values())


@pytest.mark.parametrize("tensor", ["output", "prefix_dk"])
def test_an_error_a_few_percent_past_bf16_is_out_of_bounds(monkeypatch, tensor):
    def corrupt(name, value):
        return value * 1.05 if name == tensor else value

    entry = _sdpa(monkeypatch, corrupt)
    assert not entry["within_bound"]
    assert entry["span_errors"][tensor] > entry["bounds"][tensor]

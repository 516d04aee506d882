"""The others' CPU: what the machine used minus what our processes used, per wall second, on
the busiest host; unknown without /proc."""
import pytest

from seq1f1b import machine_load
from seq1f1b.machine_load import CpuSample


def test_others_are_the_machine_minus_our_family_per_second():
    starts = [CpuSample("a", 0.0, 100.0, 1.0), CpuSample("a", 0.0, 100.0, 2.0)]
    ends = [CpuSample("a", 2.0, 104.0, 2.5), CpuSample("a", 2.0, 104.0, 3.9)]
    # machine 4 s over 2 s of wall, ours 1.5 + 1.9 = 3.4 s: others 0.3 cores
    assert machine_load.others_cores(starts, ends) == pytest.approx(0.3)


def test_the_busiest_host_counts_and_no_proc_is_unknown():
    starts = [CpuSample("a", 0.0, 0.0, 0.0), CpuSample("b", 0.0, 0.0, 0.0)]
    ends = [CpuSample("a", 1.0, 1.0, 1.0), CpuSample("b", 1.0, 1.5, 0.5)]
    assert machine_load.others_cores(starts, ends) == pytest.approx(1.0)
    blind = [CpuSample("a", 1.0, None, 1.0), CpuSample("b", 1.0, 1.5, 0.5)]
    assert machine_load.others_cores(starts, blind) is None


def test_a_sample_reads_this_machine():
    first, second = machine_load.sample(), machine_load.sample()
    assert second.wall >= first.wall and second.family >= first.family
    if first.machine is not None:                 # Linux
        assert second.machine >= first.machine > 0


def test_the_processor_is_named_with_its_cores():
    words = machine_load.processor()
    assert words.endswith(" cores") and int(words.rsplit(", ", 1)[1].split()[0]) >= 1
    assert not words.startswith(",")

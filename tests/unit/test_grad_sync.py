"""Where the executor opens megatron's grad-sync windows and prefetches parameters, read off the
plan: before each chunk's last B (so the W actions after it are counted too), chunk 0's gather
at the start and chunk c+1's at the first forward of chunk c."""
import contextlib
from types import SimpleNamespace

from seq1f1b.plan import registry
from seq1f1b.runtime.grad_sync import GradSync


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def no_sync(self, chunk: int):
        @contextlib.contextmanager
        def context():
            self.events.append(f"no_sync {chunk}")
            yield
            self.events.append(f"sync {chunk}")
        return context

    def param_sync(self, chunk: int):
        return lambda params: self.events.append(f"gather {chunk}")


def _walk(schedule, rank: int, per_chunk: bool, with_gather: bool = True) -> list[str]:
    chunks = schedule.chunks
    rec = _Recorder()
    no_sync = [rec.no_sync(c) for c in range(chunks)] if per_chunk else rec.no_sync(0)
    gather = [rec.param_sync(c) for c in range(chunks)] if with_gather else None
    config = SimpleNamespace(no_sync_func=no_sync, param_sync_func=gather)
    model = [SimpleNamespace(parameters=lambda: iter(())) for _ in range(chunks)]
    program = schedule.programs[rank]
    sync = GradSync(program, model, config)
    sync.start()
    for n, action in enumerate(program):
        sync.before(n)
        rec.events.append(action.format(chunks > 1))
    sync.finish()
    return rec.events


def test_split_backward_window_opens_before_the_last_b_and_covers_the_ws_after_it():
    events = _walk(registry.build("seq1f1b-zb-h1", 2, 2, 2, 1), 0, per_chunk=False)
    assert events == ["no_sync 0", "gather 0", "F0.0", "F0.1", "F1.0", "B0.1", "W0.1", "F1.1",
                      "B0.0", "W0.0", "B1.1", "sync 0", "B1.0", "W1.1", "W1.0"]


def test_interleaved_chunks_get_their_own_windows_and_prefetches():
    events = _walk(registry.build("seq1f1b-interleaved", 2, 2, 1, 2), 0, per_chunk=True)
    assert events == ["no_sync 0", "no_sync 1", "gather 0", "gather 1", "F0.0@0", "F1.0@0",
                      "F0.0@1", "F1.0@1", "B0.0@1", "sync 1", "B1.0@1", "B0.0@0", "sync 0",
                      "B1.0@0"]


def test_one_no_sync_for_all_chunks_opens_at_the_earliest_last_b():
    events = _walk(registry.build("seq1f1b-interleaved", 2, 2, 1, 2), 0, per_chunk=False,
                   with_gather=False)
    assert events == ["no_sync 0", "F0.0@0", "F1.0@0", "F0.0@1", "F1.0@1", "B0.0@1", "sync 0",
                      "B1.0@1", "B0.0@0", "B1.0@0"]

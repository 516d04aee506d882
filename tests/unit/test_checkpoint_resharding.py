"""What a run may take from a checkpoint saved at another parallel layout (pure: the records are
built here; tests/distributed/test_training.py resumes real checkpoints across layouts)."""
from __future__ import annotations

import argparse

import pytest

from megatron.training.checkpoint_resharding import (
    DP_RESHARDABLE, FULLY_RESHARDABLE, CheckpointRecord, ParallelLayout, check_resume,
    optimizer_format, record_entries)

FOLDER = "ckpt/iter_0000003"


def _args(tp: int = 1, pp: int = 4, vp=None, dp: int = 1, distributed: bool = False,
          fully_reshardable: bool = False, padded_vocab_size: int = 384) -> argparse.Namespace:
    return argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, data_parallel_size=dp,
        use_distributed_optimizer=distributed, dist_ckpt_optim_fully_reshardable=fully_reshardable,
        padded_vocab_size=padded_vocab_size)


def _record(tp: int = 2, pp: int = 2, vp=1, dp: int = 1, padded_vocab_size=512,
            optimizer=None) -> CheckpointRecord:
    common = {"parallel_layout": [pp, tp, dp],
              **record_entries(vp, padded_vocab_size, optimizer)}
    return CheckpointRecord.from_common(common)


def test_the_record_round_trips_through_the_common_state():
    record = _record(tp=2, pp=2, vp=2, dp=1, padded_vocab_size=512, optimizer=FULLY_RESHARDABLE)
    assert record == CheckpointRecord(ParallelLayout(2, 2, 2, 1), 512, FULLY_RESHARDABLE, True)
    assert str(record.layout) == "TP2 x PP2 x V2 x DP1"


def test_a_record_from_before_the_layout_record_leaves_the_unknowns_unknown():
    record = CheckpointRecord.from_common({"parallel_layout": [2, 1, 2]})
    assert record == CheckpointRecord(ParallelLayout(1, 2, None, 2), None, None, False)
    assert str(record.layout) == "TP1 x PP2 x V? x DP2"


def test_the_optimizer_format_follows_the_flags():
    assert optimizer_format(False, True) is None
    assert optimizer_format(True, False) == DP_RESHARDABLE
    assert optimizer_format(True, True) == FULLY_RESHARDABLE


def test_the_model_and_a_fully_reshardable_optimizer_reshard_and_keep_the_padded_vocabulary():
    args = _args(tp=1, pp=4)
    check_resume(args, _record(tp=2, pp=2, padded_vocab_size=512), FOLDER)
    assert args.padded_vocab_size == 512
    args = _args(tp=1, pp=2, vp=2, dp=2, distributed=True, padded_vocab_size=384)
    check_resume(args, _record(tp=1, pp=4, optimizer=FULLY_RESHARDABLE, padded_vocab_size=384),
                 FOLDER)
    assert args.padded_vocab_size == 384


def test_a_dp_reshardable_optimizer_reshards_across_dp_only():
    saved = _record(tp=1, pp=2, vp=2, dp=2, optimizer=DP_RESHARDABLE, padded_vocab_size=384)
    check_resume(_args(tp=1, pp=2, vp=2, dp=1, distributed=True), saved, FOLDER)
    for other in (dict(tp=2, pp=2, vp=2, dp=1), dict(tp=1, pp=4, vp=None, dp=1),
                  dict(tp=1, pp=2, vp=None, dp=2)):
        with pytest.raises(ValueError, match=r"^--load: ckpt/iter_0000003 holds the distributed "
                           r"optimizer's state in the dp_reshardable format.*saved at "
                           r"TP1 x PP2 x V2 x DP2.*--dist-ckpt-optim-fully-reshardable"):
            check_resume(_args(**other, distributed=True), saved, FOLDER)


def test_an_unrecorded_virtual_size_compares_tp_and_pp_only():
    saved = CheckpointRecord(ParallelLayout(1, 2, None, 2), 384, DP_RESHARDABLE, True)
    check_resume(_args(tp=1, pp=2, vp=2, dp=2, distributed=True), saved, FOLDER)


def test_the_optimizer_must_be_read_the_way_it_was_saved():
    with pytest.raises(ValueError, match="^--load: .* was saved with --use-distributed-optimizer"):
        check_resume(_args(), _record(optimizer=FULLY_RESHARDABLE), FOLDER)
    with pytest.raises(ValueError, match="^--load: .* was saved without --use-distributed-opt"):
        check_resume(_args(distributed=True), _record(optimizer=None), FOLDER)
    old = CheckpointRecord(ParallelLayout(2, 2, None, 1), None, None, False)
    check_resume(_args(distributed=True), old, FOLDER)      # unknown: left to the loader


def test_a_padded_vocabulary_this_tp_cannot_split_is_refused():
    with pytest.raises(ValueError, match="^--load: .* padded vocabulary of 384 rows, which "
                                         "--tensor-model-parallel-size 5 does not divide"):
        check_resume(_args(tp=5, pp=1, padded_vocab_size=640), _record(padded_vocab_size=384),
                     FOLDER)

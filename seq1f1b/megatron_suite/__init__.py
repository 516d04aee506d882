"""The peer suite's logic: Megatron-LM's own schedule tests run against our schedule functions
(tools/megatron_schedule_tests.py launches them, tools/megatron_schedule_worker.py is one rank).
slots.py checks our functions in megatron-core's slots, rank_report.py records a rank's outcomes,
results.py merges and renders them.
"""

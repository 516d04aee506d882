"""The layout planner: which TP x CP x PP x V x k x schedule x recompute to launch, and its flags.

space.py enumerates the layouts, search.py ranks them (memory verdict first, then the
projection, bounded so most are never simulated), replay.py and held.py are the simulator's
timing and held bytes compiled once per schedule shape, devices.py the GPUs, launch.py the
winner's pretrain_gpt.py flags and sbatch script, report.py the table and JSON. tools/plan.py
tune is the command line; docs/planner.md the page.
"""

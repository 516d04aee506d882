"""tools/reproduce_paper.py --launch DIR --submit against the session's real Slurm.

Every job of the paper's sweep goes through sbatch (examples/slurm/sweep.sh) to start an hour
later (`--begin=now+1hour`, an sbatch option given after `--`) and is cancelled before, so none
runs: Slurm accepts each as its panel's shipped script with that script's nodes, and the ids the
tool prints are Slurm's. Runs after test_slurm_launch.py (file order), so its many job ids do not
move the rendezvous ports of those jobs.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from seq1f1b.plan import paper

REPO = Path(__file__).resolve().parents[2]


def _jobs(cluster) -> dict[str, dict[str, str]]:
    """`scontrol show job` as {job id: {field: value}} (the fields used here have no spaces)."""
    jobs = {}
    for record in cluster.slurm("scontrol", "show", "job", timeout=60).split("\n\n"):
        fields = dict(item.split("=", 1) for item in record.split() if "=" in item)
        if "JobId" in fields:
            jobs[fields["JobId"]] = fields
    return jobs


def test_the_paper_sweep_is_submitted_as_the_shipped_scripts(slurm_cluster, tmp_path):
    result = subprocess.run([sys.executable, "tools/reproduce_paper.py", "--launch",
                             str(tmp_path / "paper"), "--submit", "--", "--begin=now+1hour"], cwd=REPO,
                            env=slurm_cluster.env, capture_output=True, text=True, timeout=300)
    printed = {line.split()[1]: line.split()[2] for line in result.stdout.splitlines()
               if line.startswith("submitted ")}
    try:
        assert result.returncode == 0, result.stderr
        assert len(printed) == sum(sweep.jobs for sweep in paper.sweeps())
        jobs = _jobs(slurm_cluster)
        for job_id, model in printed.items():
            panel = next(panel for panel in paper.PANELS if panel.model == model)
            job = jobs[job_id]
            assert (job["JobState"], job["Reason"]) == ("PENDING", "BeginTime"), job
            assert Path(job["WorkDir"]) == REPO
            assert Path(job["WorkDir"], job["Command"]).resolve() == REPO / panel.script
            assert int(job["NumNodes"].split("-")[0]) * 8 == panel.gpus, job
    finally:
        if printed:
            slurm_cluster.slurm("scancel", *printed, timeout=60)

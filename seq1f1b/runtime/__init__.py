"""The runtime: how a plan from `seq1f1b.plan` runs on this rank's megatron-core model chunks."""

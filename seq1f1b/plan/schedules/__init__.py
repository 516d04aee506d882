"""Schedule families. Each module registers its names on import, in this order:
gpipe, 1f1b, seq1f1b, interleaved-1f1b, seq1f1b-interleaved, zb-h1, seq1f1b-zb-h1."""
from seq1f1b.plan.schedules import gpipe, one_f_one_b, interleaved, zero_bubble  # noqa: F401

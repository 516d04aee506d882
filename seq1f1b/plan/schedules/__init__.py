"""Schedule families. Each module registers its names on import, in this order:
gpipe, 1f1b, seq1f1b, interleaved-1f1b, seq1f1b-interleaved, zb-h1, seq1f1b-zb-h1, zbv,
seq1f1b-zbv, seq1f1b-zb-auto. The search's greedy, refine and anneal modules are the mypyc build's
where it is current (compiled.py), before any of them is imported."""
from seq1f1b.plan.schedules import compiled

compiled.use_current_build(__path__)

from seq1f1b.plan.schedules import (gpipe, interleaved, one_f_one_b, zero_bubble,  # noqa: E402,F401
                                    zero_bubble_v)

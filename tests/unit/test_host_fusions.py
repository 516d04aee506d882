"""megatron-core's fused kernels stay plain functions on a host without CUDA
(seq1f1b/host_fusions.py): a process that imports our runtime and runs a span's attention imports
neither dynamo nor inductor, while megatron-core imported on its own still does."""
import json
import subprocess
import sys

OURS_FIRST = """
import json, sys
import torch
import seq1f1b.runtime.executor
import megatron.core.jit
from seq1f1b.runtime.attention import _sdpa
q, k = torch.randn(3, 1, 2, 4), torch.randn(5, 1, 2, 4)     # a later span: 3 queries, 5 keys
_sdpa(q, k, k, None, 0.5, 0.0)
print(json.dumps([megatron.core.jit.jit_fuser is megatron.core.jit.noop_decorator,
                  sorted({m.split(".")[1] for m in sys.modules
                          if m.startswith(("torch._dynamo", "torch._inductor"))})]))
"""

MEGATRON_FIRST = OURS_FIRST.replace("import seq1f1b.runtime.executor\n",
                                    "import megatron.core\nimport seq1f1b.runtime.executor\n")


def _probe(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_our_runtime_imports_neither_dynamo_nor_inductor_on_a_cpu():
    assert _probe(OURS_FIRST) == [True, []]


def test_megatron_core_imported_first_keeps_its_compiled_kernels():
    """What the hook saves, and that it is still needed: megatron-core 0.16.1 on its own
    decorates with torch.compile and imports both."""
    assert _probe(MEGATRON_FIRST) == [False, ["_dynamo", "_inductor"]]

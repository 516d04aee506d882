"""megatron-core's fused kernels are compiled on their first call, not on import
(seq1f1b/deferred_compile.py): a process that imports the runtime imports neither dynamo nor
inductor."""
import subprocess
import sys

from seq1f1b.deferred_compile import deferred

PROBE = """
import sys
import seq1f1b.runtime.executor
import megatron.core.jit
import torch
print(megatron.core.jit.jit_fuser is torch.compile,
      any(m.startswith(("torch._dynamo", "torch._inductor")) for m in sys.modules))
"""


def test_importing_the_runtime_imports_neither_dynamo_nor_inductor():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def test_a_deferred_function_is_compiled_once_on_its_first_call():
    compiled = []

    def compile_fn(fn):
        compiled.append(fn)
        return lambda x: fn(x) + 100

    @deferred(compile_fn)
    def double(x):
        """Twice x."""
        return 2 * x

    assert compiled == [] and double.__doc__ == "Twice x."
    assert double(1) == 102 and double(2) == 104
    assert len(compiled) == 1

"""megatron-core's import-time notices, hidden where a tool's own output must stand alone.

megatron-core warns, once per optional kernel library it falls back from (Transformer Engine,
Apex), that it is not installed, and about its own deprecated defaults; a tool's one-line refusal
or its table would come after a dozen such lines. Call before megatron-core is imported.
"""
from __future__ import annotations

import warnings


def hide_import_notices(future_warnings: bool = False) -> None:
    """Hide the fallback and deprecated-default notices; with `future_warnings`, also torch's
    FutureWarnings of the checkpoint API megatron-core calls (the checkpoint tools)."""
    warnings.filterwarnings("ignore", message=r"(?s).*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    if future_warnings:
        warnings.filterwarnings("ignore", category=FutureWarning)

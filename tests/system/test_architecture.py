"""The house's floors: raysim's modules import only downwards, and no module takes part in an import cycle.

The import graph is read from the source with `ast` (nothing is imported), counting every import: at module level,
inside functions and under `if TYPE_CHECKING:`. `from package import name` is an edge to `package` and, when `name`
is a module, to `package.name` too. docs/concepts.md draws the floors.
"""

from __future__ import annotations

import subprocess
import sys


def test_the_vector_only_modules_load_without_torch():
    """The coordinator's modules (the model registry and parameter layout), the evaluation records, columns and
    summaries, and the round callbacks import no torch (a process that only moves vectors never loads it)."""
    modules = ["raysim.models.spec", "raysim.evaluation.summaries", "raysim.tracking.callbacks"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"

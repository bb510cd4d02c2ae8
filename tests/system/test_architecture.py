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


def test_a_refused_experiment_costs_no_torch_ray_or_mlflow(tmp_path):
    """`raysim run` validates the file before it imports the driver: a refused config is one line after about 0.8
    CPU s (raysim's config and its registries), not after 2.7 s of torch, Ray and MLflow imports."""
    (tmp_path / "bad.yaml").write_text("algorithm: {name: flame}\nrounds: 0\n")
    code = (
        "import sys; from raysim.cli import main; code = main(['run', sys.argv[1]]); "
        "print(code, [name for name in ('torch', 'ray', 'mlflow') if name in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code, tmp_path / "bad.yaml"], capture_output=True, text=True)
    assert done.stdout == "2 []\n", (done.stdout, done.stderr)
    assert done.stderr.startswith("error: rounds: ") and done.stderr.count("\n") == 1, done.stderr

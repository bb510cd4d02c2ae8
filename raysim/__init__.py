"""raysim: Ray-based simulation of personalized federated learning solved with ADMM.

From Python: `raysim.run(config, *overrides)` runs an experiment and returns a `raysim.Result`, `raysim.run_suite`
a suite (raysim.api, docs/python-api.md). They are imported on first use, so that `import raysim` starts no Ray,
torch or pandas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Result", "RunFailed", "SuiteResult", "run", "run_suite"]

if TYPE_CHECKING:
    from raysim.api import Result, RunFailed, SuiteResult, run, run_suite


def __getattr__(name: str) -> Any:
    if name in __all__:
        from raysim import api

        return getattr(api, name)
    raise AttributeError(f"module 'raysim' has no attribute {name!r}")

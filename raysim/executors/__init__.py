"""Executors: how a host runs its selected clients' requests (`runtime.client_training`), chosen by name through
the EXECUTORS registry, the same door a plugin's executor comes in by (docs/extending.md).

A host hands its executor the requests of a chunk of clients (`clients_at_once` of them, in the fixed blocks the
host keeps their states in) in one of two shapes, and the executor answers with results:

- a turn (`run_turn`): one pending request per client of the chunk, in lockstep (raysim.execution.drivers
  `run_client_steps`); each job is (request, the client's data, the generator of its next request number);
- rows (`run_rows`): one stacked request for all the chunk's clients, when the algorithm stacks
  (Algorithm.stacks) and the executor `stacks`; it returns one stacked result.

The host draws every generator (keyed by seed, stream, client, round and request number), so an executor decides
how the requests run, never what randomness they see: each executor gives every client the results it would get
alone, up to floating-point summation order (tests/integration/test_vectorized.py). The built-ins are one module
each (`sequential`, `vectorized`), as a plugin's executor is one file.
"""

from raysim.executors import sequential, vectorized  # noqa: F401  (the built-ins register)
from raysim.executors.base import EXECUTORS, Executor, ExecutorContext, Job, build_executor

__all__ = ["EXECUTORS", "Executor", "ExecutorContext", "Job", "build_executor"]

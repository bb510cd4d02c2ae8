"""Ray job entrypoint: one experiment, its config carried in $RAYSIM_JOB_CONFIG (see raysim.jobs).

Run from the job's working directory (the shipped project), whose raysim package it imports first and
entirely (the job's log ends with `raysim code: FOLDER`, where its raysim modules came from).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raysim.jobs import entrypoint  # noqa: E402

if __name__ == "__main__":
    sys.exit(entrypoint("experiment"))

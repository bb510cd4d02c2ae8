"""Models: the networks, registered by name in MODELS (`zoo` holds the built-ins, imported here so that they register;
a plugin's register the same way), the flat-vector view used everywhere else (`flat`, torch), and what describes a
model without torch (`spec`)."""

from raysim.models import zoo  # noqa: F401
from raysim.models.spec import MODELS

__all__ = ["MODELS"]

"""What the augfl tests of several tiers share."""

from __future__ import annotations

META = {"scheme": "meta", "shots": 20, "reserved": 300, "server_samples": 256, "val_fraction": 0.5}

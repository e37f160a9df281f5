"""The display name of each attention type in a comparison's tables and plots."""

from __future__ import annotations

NAMES = {"baseline": "Transformer", "diff_v1": "DIFF V1", "diff_v2": "DIFF V2"}

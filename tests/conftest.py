"""Shared test set-up: hypothesis profiles and a controllable clock.

`HYPOTHESIS_PROFILE=ci` (set by .ci/run) runs many more examples than the
quick default used on a developer's machine.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile(
    "ci", max_examples=1000, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

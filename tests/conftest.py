"""Shared test set-up: hypothesis profiles, frame checks, and a controllable clock.

`HYPOTHESIS_PROFILE=ci` (set by .ci/run) runs many more examples than the
quick default used on a developer's machine.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

try:
    from kvfsm.backends._remote_endpoint import RemoteEndpoint
except ImportError:  # no pyzmq: the remote backends' tests skip
    pass
else:
    # Every frame an endpoint of the suite sends is checked field by field before it goes
    # out (production skips it): a sender bug fails the test that made it, not a peer.
    RemoteEndpoint.check_frames = True

settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile(
    "ci", max_examples=1000, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

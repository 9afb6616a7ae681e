"""Load shapes as pure schedules: elapsed seconds -> (users, spawn rate), or None when the run is over.

The locustfile wraps the configured schedule in one ``LoadTestShape``. ``poisson`` is open loop: a fixed
set of arrival users fire requests at exponential intervals whatever the response times (``OpenLoopUser``
in locust_plugin.py).
"""

from __future__ import annotations

from dataclasses import dataclass

SHAPES = ("constant", "step", "spike", "poisson")


@dataclass(frozen=True)
class ShapeConfig:
    shape: str = "constant"
    duration_s: float = 60.0
    users: int = 4  # constant: users; step: the last step's users; spike: the base level
    spawn_rate: float = 10.0
    step_users: int = 2  # step: users added per step (the first step has step_users)
    step_duration_s: float = 30.0
    spike_users: int = 16  # spike: users during the spike
    spike_at_s: float = 20.0
    spike_duration_s: float = 10.0
    rate: float = 1.0  # poisson: requests per second over all workers
    arrival_users: int = 1  # poisson: independent arrival processes (use at least one per worker)

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}")
        positive = {
            "duration_s": self.duration_s,
            "users": self.users,
            "spawn_rate": self.spawn_rate,
            "step_users": self.step_users,
            "step_duration_s": self.step_duration_s,
            "spike_users": self.spike_users,
            "rate": self.rate,
            "arrival_users": self.arrival_users,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.spike_at_s < 0 or self.spike_duration_s <= 0:
            raise ValueError("spike_at_s must be >= 0 and spike_duration_s > 0")

    def users_at(self, elapsed_s: float) -> int | None:
        """Target users at ``elapsed_s`` (arrival users for poisson); None once the duration is over."""
        if elapsed_s >= self.duration_s:
            return None
        if self.shape == "step":
            step = int(elapsed_s // self.step_duration_s) + 1
            return min(self.users, step * self.step_users)
        if self.shape == "spike":
            in_spike = self.spike_at_s <= elapsed_s < self.spike_at_s + self.spike_duration_s
            return self.spike_users if in_spike else self.users
        if self.shape == "poisson":
            return self.arrival_users
        return self.users

    @property
    def open_loop(self) -> bool:
        return self.shape == "poisson"

    @property
    def rate_per_arrival_user(self) -> float:
        # The sum of independent Poisson processes is a Poisson process with the summed rate.
        return self.rate / self.arrival_users

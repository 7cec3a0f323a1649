"""Intermittent CPU throttling of one process (a Pi that throttles, a busy laptop) with cgroup v1.

    with CpuThrottle(pid, quota=0.1, period_s=0.3):   # 10 % of a core during every other 300 ms
        ...
    with CpuThrottle(pid, quota=0.25, period_s=None):  # a device with a quarter of a core, all the time

Moves the process into its own cgroup under /sys/fs/cgroup/cpu and, in a background thread, switches
its CFS quota between `quota` cores and unlimited every `period_s` (None: the quota holds throughout).
`cfs_period_us` is the scheduler's accounting period (shorter: the quota's stalls are shorter and
more frequent, as a slower CPU's would be). Needs root and the cgroup-v1 cpu
controller; `available()` says why not.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1000  # the smallest cpu.cfs_quota_us cgroup v1 takes


def available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "cgroups need root"
    if not (ROOT / "cpu.cfs_quota_us").exists():
        return False, f"no cgroup-v1 cpu controller at {ROOT}"
    return True, ""


class CpuThrottle:
    def __init__(self, pid: int, quota: float = 0.1, period_s: float | None = 0.3, name: str | None = None,
                 cfs_period_us: int = CFS_PERIOD_US):
        if not 0 < quota:
            raise ValueError("quota is a positive number of cores")
        if not 1000 <= cfs_period_us <= 1_000_000:  # (the kernel's range: past it __enter__ failed and left the group)
            raise ValueError(f"cfs_period_us {cfs_period_us}: from 1000 to 1000000")
        if period_s is not None and not period_s > 0:  # (0 toggled the quota in a loop: a whole core)
            raise ValueError(f"period_s {period_s}: above 0, or None for a quota that holds throughout")
        if quota * cfs_period_us < MIN_QUOTA_US:  # the kernel refuses it (EINVAL): the throttle would do nothing
            raise ValueError(f"a quota of {quota:g} cores is {quota * cfs_period_us:.0f} us per {cfs_period_us} us "
                             f"period, under the kernel's {MIN_QUOTA_US} us: give a longer cfs_period_us or a larger "
                             "quota")
        self.pid, self.quota, self.period_s, self.cfs_period_us = pid, quota, period_s, cfs_period_us
        self.group = ROOT / (name or f"halo-throttle-{pid}")
        self._stop = threading.Event()
        self.toggles = 0

    def __enter__(self) -> "CpuThrottle":
        self.group.mkdir(exist_ok=True)
        (self.group / "cpu.cfs_period_us").write_text(str(self.cfs_period_us))
        for task in Path(f"/proc/{self.pid}/task").iterdir():  # every thread of the process
            (self.group / "tasks").write_text(task.name)
        self._thread = None
        if self.period_s is None:
            (self.group / "cpu.cfs_quota_us").write_text(str(int(self.quota * self.cfs_period_us)))
        else:
            self._thread = threading.Thread(target=self._toggle, daemon=True)
            self._thread.start()
        return self

    def _toggle(self) -> None:
        limited = False
        while not self._stop.wait(self.period_s):
            limited = not limited
            quota = int(self.quota * self.cfs_period_us) if limited else -1
            try:
                (self.group / "cpu.cfs_quota_us").write_text(str(quota))
                self.toggles += 1
            except OSError:
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            (self.group / "cpu.cfs_quota_us").write_text("-1")
            for task in (self.group / "tasks").read_text().split():
                (ROOT / "tasks").write_text(task)
            self.group.rmdir()
        except OSError:
            pass  # the process is gone: the empty group is removed with it below
        try:
            self.group.rmdir()
        except OSError:
            pass

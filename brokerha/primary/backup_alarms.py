"""The backups' resource alarms, as the primary applies them to its publishers.

Every confirm and commit-ok waits until each ready backup holds the data
(architecture.md), so a ready backup whose disk is short blocks publishers
just as the primary's own disk would: its alarms become the primary's
``disk:<backup>`` alarm. A backup that is not ready does not count for
confirms, so its alarm blocks nobody; a backup that leaves takes its alarm
with it. Sans-I/O: the HA node feeds reports, losses and the ready set.
"""

from __future__ import annotations

from collections.abc import Callable


class BackupAlarms:
    def __init__(self, set_alarm: Callable[[str, str | None], None]) -> None:
        self.set_alarm = set_alarm
        self.reported: dict[str, dict[str, str]] = {}  # backup -> its alarms (name -> why)
        self.applied: set[str] = set()  # alarm names set on the primary's broker

    def report(self, backup: str, alarms: dict[str, str]) -> None:
        if alarms:
            self.reported[backup] = dict(alarms)
        else:
            self.reported.pop(backup, None)

    def lost(self, backup: str) -> None:
        self.reported.pop(backup, None)

    def apply(self, ready_backups: list[str]) -> None:
        """Set the alarms of ready backups, clear the rest (on each report and tick)."""
        wanted = {f"disk:{backup}": "; ".join(f"{name} on {backup}: {why}"
                                               for name, why in sorted(alarms.items()))
                  for backup, alarms in self.reported.items() if backup in ready_backups}
        for name in sorted(self.applied - set(wanted)):
            self.set_alarm(name, None)
        for name, why in sorted(wanted.items()):
            self.set_alarm(name, why)
        self.applied = set(wanted)

    def clear(self) -> None:
        """This node stopped being the primary: its publishers are gone."""
        self.reported.clear()
        self.apply([])

"""Which side of the device is live (the colocation phase). Engines and the trainer check it before
they touch memory; colocate/switch.py moves it."""

from __future__ import annotations

import enum

from colo_rl.errors import PhaseError


class Phase(str, enum.Enum):
    IDLE = "idle"  # start-up: nothing handed off yet
    GENERATION = "generation"  # engine holds weights + KV cache; trainer states paged out
    UPDATE = "update"  # trainer holds its states; engine released
    BROKEN = "broken"  # a switch failed midway: memory is in neither phase's layout, nothing may use it



class PhaseGuard:
    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def require(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            hint = "inside `with switch.generation():`" if phase is Phase.GENERATION else "inside `with switch.update():`"
            raise PhaseError(f"{what} needs the {phase.value} phase but the current phase is "
                             f"{self.phase.value}; call it {hint}")

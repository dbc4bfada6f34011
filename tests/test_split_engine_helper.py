"""A TP engine's other rank in a split run's generation pool (`EngineHelper`): real torchrun ranks
(gloo, CPU). Rank 0 plays the generator's side of the heartbeat as `GenerationPool._beat` sends it;
rank 1 runs the helper. Run as a script by torchrun, this file is the worker; rank 1 writes what
it saw to <out>/helper.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_torchrun

BEATS = 3


def worker(out: Path, mode: str) -> None:
    from colo_rl import dist
    from colo_rl.errors import PoolError
    from colo_rl.split.placement import SplitLayout
    from colo_rl.split.roles import EngineHelper, SplitRole
    from colo_rl.split.wire import send_beat

    dist.init()
    layout = SplitLayout(world=2, generation=(0,), trainers=(), tp_size=2)  # the trainers play no part here
    (group,) = dist.new_host_groups([[0, 1]], timeout_minutes=2)
    if dist.job_rank() == 0:
        for slot in range(BEATS):
            send_beat(slot, 1, group).wait()
        if mode == "dies":
            # As a SIGKILLed generator: no end marker, its sockets close. Exit 0, not an error code:
            # torchrun would kill the helper on a failed rank before it could tell what it saw.
            os._exit(0)
        send_beat(None, 1, group).wait()
        return
    seen: dict = {}
    try:
        seen["beats"] = EngineHelper(SplitRole(layout, generates=False, weight_group=None, helps=True,
                                                    tp_group=group)).serve()
    except PoolError as e:
        seen["error"] = str(e)
    (out / "helper.json").write_text(json.dumps(seen))
    os._exit(0)  # not the process group's shutdown barrier: rank 0 may be gone


@pytest.mark.parametrize("mode", ["ends", "dies"])
def test_helper_waits_for_its_generators_end_and_names_it_when_it_dies(tmp_path, mode):
    proc = run_torchrun(Path(__file__), [str(tmp_path), mode], timeout=120, check=False)
    assert (tmp_path / "helper.json").exists(), proc.stdout + proc.stderr
    seen = json.loads((tmp_path / "helper.json").read_text())
    if mode == "ends":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert seen == {"beats": BEATS}
    else:  # the helper stops at once with the generator named, instead of waiting out a timeout
        assert "generation rank 0 (its engine runs on this rank's GPU) stopped answering" in seen["error"], seen


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from colo_rl import process_exit

    process_exit.run_and_exit(lambda: worker(Path(sys.argv[1]), sys.argv[2]))  # no teardown race with gloo's threads

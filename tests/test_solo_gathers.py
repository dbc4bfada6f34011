"""colo_rl/solo_gathers.py: in a world of one, DeepSpeed's all-gathers of host tensors are local
copies, so gloo's worker threads never start an OpenMP team of their own (which made libgomp stop
spinning between the main thread's parallel ops: docs/update_overhead.md)."""

import json
import subprocess
import sys

import pytest

from colo_rl.solo_gathers import LOCAL_GATHERS_ENV, local_gathers_wanted
from conftest import child_env, child_python_path

# A world of one on two intra-op threads: DeepSpeed's gather calls checked, then one ZeRO-3 update of
# a tiny model; the threads named like gloo's workers counted after dist.init and after the update
# (an OpenMP team started on one of them adds threads of the same name), and the trained weights' digest.
PROBE = """
import hashlib, json, os, torch
torch.set_num_threads(2)
from colo_rl import dist
dist.init()

def gloo_threads():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))

import time
deadline = time.monotonic() + 60  # the default group's two runloops name themselves once started: wait for them
while gloo_threads() < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
before = gloo_threads()
import deepspeed.comm as ds_comm
x = torch.arange(1 << 16, dtype=torch.float32)
out = torch.empty_like(x); handle = ds_comm.all_gather_into_tensor(out, x, async_op=True); handle.wait()
outs = [torch.empty_like(x)]; ds_comm.all_gather(outs, x)
gathers_copy = bool(torch.equal(out, x) and torch.equal(outs[0], x))

from colo_rl.config import ModelConfig, RunConfig
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.batch import build_batch
from colo_rl.train.packing import pack_groups

cfg = RunConfig()
cfg.model = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")
cfg.trainer.zero_stage = 3
actor = DeepSpeedActor(cfg, torch.float32, total_steps=2, grad_accum=1)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (20,), generator=g).tolist()
responses = [torch.randint(100, 40000, (12,), generator=g).tolist() for _ in range(4)]
mb = pack_groups([(prompt, responses, build_batch([prompt] * 4, responses, 0).select(list(range(4))))], torch.float32)
logp, _ = actor.response_logprobs(mb, 1.0)
actor.backward(-(logp * mb.response_mask).sum() / mb.response_mask.sum(), last_micro_batch=True)
actor.step()
after = gloo_threads()
state = actor.full_state_dict_on_rank0()
digest = hashlib.sha256(b"".join(state[k].contiguous().numpy().tobytes() for k in sorted(state))).hexdigest()
print(json.dumps({"gathers_copy": gathers_copy, "gloo_threads": [before, after], "digest": digest}))
"""


def probe(local: str) -> dict:
    env = child_env(PYTHONPATH=child_python_path(), CUDA_VISIBLE_DEVICES="", **{LOCAL_GATHERS_ENV: local})
    env.pop("OMP_NUM_THREADS", None)  # as in a plain run: a gloo thread's OpenMP team takes its default size
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.e2e
def test_a_world_of_one_gathers_on_its_own_thread_and_trains_the_same_weights():
    """Local copies (the default): the gathers return the input, no gloo thread starts an OpenMP
    team during a ZeRO-3 update, and the trained weights are bit for bit those of DeepSpeed's own
    gathers, where gloo's thread does start one (what made the update slow)."""
    local, gloo = probe(""), probe("0")
    assert local["gathers_copy"] and gloo["gathers_copy"]
    # threads named pt_gloo_runloop: each group's runloops (the engine adds a group), and with gloo's
    # gathers the OpenMP workers its threads started (they inherit the name)
    assert gloo["gloo_threads"][0] == local["gloo_threads"][0]
    assert local["gloo_threads"][1] < gloo["gloo_threads"][1]
    assert local["digest"] == gloo["digest"]


def test_the_setting_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(LOCAL_GATHERS_ENV, raising=False)
    assert local_gathers_wanted()
    monkeypatch.setenv(LOCAL_GATHERS_ENV, "0")
    assert not local_gathers_wanted()
    monkeypatch.setenv(LOCAL_GATHERS_ENV, "off")
    with pytest.raises(ValueError, match="COLO_RL_LOCAL_GATHERS='off': use 1"):
        local_gathers_wanted()

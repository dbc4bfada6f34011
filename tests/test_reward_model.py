"""The reward model (reward.model.path) and user reward files in real GRPO runs.

A tiny random LlamaForSequenceClassification with the embedded tokenizer stands in for a reward
model: its scores must be the head's output at each text's last token (checked against the plain HF
model one text at a time) and must follow its weights (a head scaled by -3 scores -3x). In split
placement: tests/test_split_placement.py.
"""

import json

import pytest
import torch
from conftest import WORKERS, run_torchrun

from colo_rl.config import ConfigError, ModelConfig
from colo_rl.models import load_tokenizer, model_config
from colo_rl.train.reward_model import check_reward_model_config

pytestmark = pytest.mark.slow  # each test starts torchrun (2 gloo ranks): 30-90 s on the 2-core CPU


def make_tiny_reward_model(directory, seed: int = 0, head_scale: float = 1.0):
    """A random 2-layer LlamaForSequenceClassification (num_labels=1) with the embedded tokenizer."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer("embedded")
    config = model_config(ModelConfig(path="embedded", random_init=True, hidden_size=64, num_layers=2))
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.mul_(head_scale)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_causal_lm_is_refused_as_reward_model():
    config = model_config(ModelConfig(path="embedded"))
    with pytest.raises(ConfigError, match=r"holds \['LlamaForCausalLM'\], not a \*ForSequenceClassification model"):
        check_reward_model_config("/models/policy", config)
    config.architectures, config.num_labels = ["LlamaForSequenceClassification"], 2
    with pytest.raises(ConfigError, match=r"num_labels=2: a reward model gives one score"):
        check_reward_model_config("/models/rm", config)


def test_reward_model_scores_follow_its_weights(tmp_path):
    rm_a = make_tiny_reward_model(tmp_path / "rm_a", seed=0)
    rm_b = make_tiny_reward_model(tmp_path / "rm_b", seed=0, head_scale=-3.0)
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(WORKERS / "reward_model_worker.py", [str(out), str(rm_a), str(rm_b)], timeout=600)
    for rank in (0, 1):
        a = json.loads((out / f"rm_a.rank{rank}.json").read_text())
        b = json.loads((out / f"rm_b.rank{rank}.json").read_text())
        # ZeRO-3 over 2 ranks, micro-batches of 2 with right padding == the HF model on each text alone
        assert a["scores"] == pytest.approx(a["reference"], abs=1e-5)
        assert b["scores"] == pytest.approx(b["reference"], abs=1e-5)
        assert b["scores"] == pytest.approx([-3.0 * s for s in a["scores"]], rel=1e-4, abs=1e-6)
        assert len({round(s, 6) for s in a["scores"]}) == len(a["scores"])  # each text its own score
        assert a["state_bytes"] > 0 and a["moved"] is False  # paged on GPU only
        assert a["after_reload"] == a["scores"]
    r0 = json.loads((out / "rm_a.rank0.json").read_text())
    r1 = json.loads((out / "rm_a.rank1.json").read_text())
    assert dict(zip(r0["texts"], r0["scores"])) == pytest.approx(dict(zip(r1["texts"], r1["scores"])), abs=1e-5)


@pytest.mark.gpu
def test_reward_model_pages_to_host_and_back_on_gpu(tmp_path):
    rm_a = make_tiny_reward_model(tmp_path / "rm_a", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(WORKERS / "reward_model_worker.py", [str(out), str(rm_a)], nproc=1, timeout=600)
    a = json.loads((out / "rm_a.rank0.json").read_text())
    assert a["moved"] is True and a["on_host_when_paged"] is True
    assert a["after_reload"] == pytest.approx(a["scores"], abs=1e-6)
    assert a["scores"] == pytest.approx(a["reference"], abs=1e-3)  # GPU kernels: not bit-equal to CPU


USER_REWARDS = '''
def length_share(completion, truth, **fields):
    """Needs the record's fields: a run that dropped them would count failures."""
    assert fields["answer"] == truth and fields["question"].startswith("What is"), fields
    return len(completion) / 100.0

def batched_one(completions, truths, question):
    return [1.0 if q.startswith("What is") else 0.0 for q in question]
'''


def test_grpo_with_a_user_reward_file_and_a_reward_model(tmp_path):
    rm = make_tiny_reward_model(tmp_path / "rm", seed=1)
    user = tmp_path / "my_rewards.py"
    user.write_text(USER_REWARDS)
    d = tmp_path / "run"
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 ["model=tiny", "trainer.total_steps=2", "data.eval_size=2", "rollout.prompts_per_step=2",
                  "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.eval_max_new_tokens=2",
                  "trainer.micro_batch_size=4", "trainer.lr=1e-3", "reward.format_weight=0",
                  f"reward.functions=[{user}:length_share,{user}:batched_one,math_verify]",
                  "reward.weights=[0.5,0.25,1.0,2.0]", f"reward.model.path={rm}", "reward.workers=1",
                  "colocate.paging=on",  # pages the reward model between phases as on a GPU (host to host)
                  "logger=[jsonl]", "plots=false", f"run_dir={d}"], timeout=600)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 2
    for row in rows:
        assert row["reward/failures"] == 0
        assert row["reward_source/my_rewards:batched_one"] == 1.0
        assert row["reward_source/my_rewards:length_share"] > 0
        assert row["reward_source/model"] != 0
        expected = (0.5 * row["reward_source/my_rewards:length_share"] + 0.25 + 1.0 * row["reward_source/math_verify"]
                    + 2.0 * row["reward_source/model"])
        assert row["reward/mean"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    ledger = [json.loads(line) for line in (d / "ledger.jsonl").read_text().splitlines()]
    moves = {(r["transition"], m["what"]): m for r in ledger for m in r["moves"]}
    for key in [("update->generation", "reward model"), ("generation->update", "reward model")]:
        assert moves[key]["bytes"] > 0 and moves[key]["moved"] is True


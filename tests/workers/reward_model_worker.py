"""Under torchrun: colo_rl's RewardModel (frozen ZeRO-3, micro-batches of 2, right padding) scores
texts of different lengths for each reward model directory given; every rank also scores them with
the plain HF model one text at a time (the head read at the last token, computed here), pages the
reward model out and back (a no-op on CPU) and scores again, and writes it all to
<out>/<dir name>.rank<r>.json.

    reward_model_worker.py OUT RM_DIR [RM_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

from colo_rl import dist, process_exit
from colo_rl.config import ModelConfig, RewardConfig, RewardModelConfig, RunConfig, TrainerConfig  # noqa: E402
from colo_rl.phase import Phase, PhaseGuard  # noqa: E402
from colo_rl.colocate.setup import frozen_paging  # noqa: E402
from colo_rl.train.reward_model import RewardModel  # noqa: E402

TEXTS = ["The answer is 4.", "2 + 2 = 4. The answer is 4.", "five", "I do not know, sorry, it could be 17 or 18.",
         "The answer is 58."]


def main(out: Path, rm_dirs: list[str]) -> None:
    dist.init()
    texts = TEXTS[dist.rank():] + TEXTS[:dist.rank()]  # each rank its own order, the same count
    for rm_dir in rm_dirs:
        cfg = RunConfig(model=ModelConfig(dtype="fp32"), trainer=TrainerConfig(micro_batch_size=2),
                        reward=RewardConfig(model=RewardModelConfig(path=rm_dir)))
        guard = PhaseGuard()  # a colocated reward model (it pages on GPU), scoring in the update phase
        guard.phase = Phase.UPDATE
        rm = RewardModel(cfg, torch.float32, guard=guard)
        scores = rm.score(texts).tolist()
        hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
        reference = []
        with torch.no_grad():
            for t in texts:
                ids = torch.tensor([rm.tokenizer(t, add_special_tokens=not rm.use_chat_template)["input_ids"]])
                hidden = hf.model(input_ids=ids).last_hidden_state
                reference.append(float(hf.score(hidden)[0, -1, 0]))
        (paging,) = frozen_paging(cfg, guard, None, rm)  # as the memory manager gets it
        moved = paging.offload_states()  # the generation phase's paging (GPU) and back
        on_host = all(t.device.type == "cpu" for t in paging.pager.tensors)
        paging.reload_states()
        record = {"texts": texts, "scores": scores, "reference": reference, "state_bytes": paging.state_bytes(),
                  "moved": moved, "on_host_when_paged": on_host, "after_reload": rm.score(texts).tolist()}
        (out / f"{Path(rm_dir).name}.rank{dist.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(Path(sys.argv[1]), sys.argv[2:]))

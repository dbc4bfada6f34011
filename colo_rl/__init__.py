"""colo_rl: colocated RL post-training (SGLang generation + DeepSpeed ZeRO-3 updates on the same devices)."""

import os

# Transparent huge pages for PyTorch's large CPU allocations (read at the first one, so this runs
# before any model loads). A step allocates GiBs of fresh activations and logits; with 2 MiB pages
# first-touch page faults stop bounding them (fresh-memory memcpy 3.5 -> 10 GiB/s on the 2-core CI
# machine; one-process ZeRO-3 update of the race's shape 23.7 -> 22.2 s). Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# DeepSpeed / torch JIT ops (FusedAdam, ...) are compiled into this environment, not into the
# machine-wide ~/.cache/torch_extensions that every checkout shares (two checkouts with different
# torch builds would rebuild each other's ops, minutes each). `make install` builds them there.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(__import__("sys").prefix, "torch_extensions"))

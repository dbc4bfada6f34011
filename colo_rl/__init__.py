"""colo_rl: colocated RL post-training (SGLang generation + DeepSpeed ZeRO-3 updates on the same devices)."""

import os
import sys

# Transparent huge pages for PyTorch's large CPU allocations (read at the first one, so this runs
# before any model loads). A step allocates GiBs of fresh activations and logits; with 2 MiB pages
# first-touch page faults stop bounding them (fresh-memory memcpy 3.5 -> 10 GiB/s on the 2-core CI
# machine; one-process ZeRO-3 update of the race's shape 23.7 -> 22.2 s). Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# DeepSpeed / torch JIT ops (FusedAdam, ...) are compiled into this environment, not into the
# machine-wide ~/.cache/torch_extensions that every checkout shares (two checkouts with different
# torch builds would rebuild each other's ops, minutes each). `make install` builds them there.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# One ninja builds them, however the run is started: torch runs the `ninja` first on PATH, and the
# venv's (pip's, a newer version) and the system's write .ninja_log differently, so each rebuilt what
# the other built (minutes each time) when `make` (system PATH) and an activated venv alternated.
# In a venv, its bin comes first (as when activated); the Makefile does the same for its own builds.
# Outside one (a system or image Python) PATH is left as it is.
_VENV_BIN = os.path.join(sys.prefix, "bin")
if sys.prefix != sys.base_prefix and os.path.isfile(os.path.join(_VENV_BIN, "ninja")) and \
        os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

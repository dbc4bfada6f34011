"""TEST SUPPORT ONLY: activates colo_rl_sglang_cpu_shim in every Python process started with
tests/sglang_cpu_shims/ on PYTHONPATH (SGLang's spawned children included). See that module."""

import colo_rl_sglang_cpu_shim

colo_rl_sglang_cpu_shim.install()
colo_rl_sglang_cpu_shim.install_lora_pin_memory()

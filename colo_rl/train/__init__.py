"""The trainer: the DeepSpeed actor, token batches, the offline (SFT / DPO) helpers."""

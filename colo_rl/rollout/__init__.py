"""Rollout engines behind one protocol (base.py): the in-process HF engine and SGLang."""

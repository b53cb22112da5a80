"""Rollout engines behind one interface (base.py): the embedded native generator and SGLang, each registered by
name with its constructor and declared capabilities in ``registry`` (what the trainer, the rollout pool, the config
check and ``verl generate`` ask instead of comparing names)."""

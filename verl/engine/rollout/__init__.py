"""Rollout engines: the embedded native generator and (later) SGLang, behind one interface (base.py)."""

"""Model configs and model builders; :class:`HFActor` / :class:`HFCritic` name any HF model as a role of the Python
API (:mod:`verl.models.hf`)."""

from verl.models.hf import HFActor, HFCritic, HFModel

__all__ = ["HFActor", "HFCritic", "HFModel"]

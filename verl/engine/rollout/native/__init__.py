"""The embedded native rollout engine: an in-process generator over the SGLang rollout layout."""

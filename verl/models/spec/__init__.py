"""One model spec per architecture family: the Megatron <-> HF <-> rollout parameter map (see ``base``)."""

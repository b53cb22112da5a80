"""``verl.data``: the documents' names for the RL data: ``verl.data.rlhf_dataset.RLHFDataset`` (the class of
:mod:`verl.utils.dataset.rl_dataset`) and ``verl.data.DataLoader`` (:mod:`verl.data.loader`: the trainer's batches),
imported on first use so that ``import verl.data`` stays light."""

__all__ = ["DataLoader", "RLHFDataset"]


def __getattr__(name: str):
    if name == "DataLoader":
        from verl.data.loader import DataLoader

        return DataLoader
    if name == "RLHFDataset":
        from verl.data.rlhf_dataset import RLHFDataset

        return RLHFDataset
    raise AttributeError(f"module 'verl.data' has no attribute {name!r}")

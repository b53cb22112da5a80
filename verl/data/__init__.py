"""``verl.data``: the documents' names for the RL datasets (``verl.data.rlhf_dataset.RLHFDataset``), the same classes
as :mod:`verl.utils.dataset.rl_dataset`."""

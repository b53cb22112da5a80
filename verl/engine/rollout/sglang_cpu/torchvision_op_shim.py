"""Installed as ``sitecustomize.py`` in the SGLang venv, so it runs in every process SGLang spawns.

PyPI's torchvision is a CUDA build; with the CPU torch its ``torchvision::nms`` op fails to
register and ``import torchvision`` (pulled in by transformers/SGLang) raises. Defining the op
schemas before torchvision loads lets the import succeed; calling nms still fails (no kernel), and
text rollout never calls it. The hook is lazy so processes that never import torchvision pay nothing.
"""

import importlib.abc
import sys


def _define_torchvision_op_schemas():
    import torch

    for op in ("nms", "qnms"):
        try:
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )
        except RuntimeError:  # already defined (a torchvision that registers its own ops)
            pass


class _TorchvisionOpSchemaHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_op_schemas()
        return None  # let the normal finders load torchvision


sys.meta_path.insert(0, _TorchvisionOpSchemaHook())

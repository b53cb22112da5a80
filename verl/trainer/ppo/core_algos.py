"""verl's public path of the PPO-family math: ``from verl.trainer.ppo import core_algos`` (as verl users'
recipes write it, to call ``register_policy_loss`` / ``register_adv_est`` or the loss functions).

The math lives in :mod:`verl.algorithms.core_algos`, below the workers that use it. This name is bound to that
same module object, so a recipe registering an estimator here registers it in the registries the trainer and
the workers read, and everything of the module (private helpers included) is reachable under either name.
"""

import sys

from verl.algorithms import core_algos

sys.modules[__name__] = core_algos

"""mmvl: a modular framework for vision-and-language research on current PyTorch.

Importing the package registers every built-in component through the explicit
imports below (no directory scanning).
"""
from mmvl import registry
from mmvl.errors import UserError

from mmvl import losses, metrics, optim  # noqa: E402,F401  (registration)
from mmvl.distributed import strategies  # noqa: E402,F401
from mmvl.data import datasets, multi, processors  # noqa: E402,F401
from mmvl import models  # noqa: E402,F401
from mmvl import trainers  # noqa: E402,F401
from mmvl.engine import Engine  # noqa: E402
from mmvl.trainers import Trainer  # noqa: E402
from mmvl.config import load_config  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Engine", "Trainer", "UserError", "load_config", "registry", "__version__"]

"""Optimizers and LR schedules: the typed sections (:mod:`.sections`), the builders
(:mod:`.optimizers`, :mod:`.schedulers`), param groups (:mod:`.groups`), what a resume restores
(:mod:`.resume`) and the state's size (:mod:`.footprint`). This face only hands their names on;
importing it registers the built-in optimizers and schedules.
"""
from mmvl.optim.groups import NO_DECAY_NAMES, param_groups
from mmvl.optim.optimizers import (FUSED_OPTIMIZERS, IMPLEMENTATION_KEYS, LR_SCALING_BASE_BATCH_SIZE, base_lr,
                                   build_optimizer, fused_supported, implementation_default, scaled_lr,
                                   trainable_only)
from mmvl.optim.resume import adopt_config_hyperparameters, implementation_of, restore_implementation
from mmvl.optim.schedulers import build_scheduler, constant, warmup_cosine, warmup_linear
from mmvl.optim.sections import optimizer_section, scheduler_section

__all__ = ["FUSED_OPTIMIZERS", "IMPLEMENTATION_KEYS", "LR_SCALING_BASE_BATCH_SIZE", "NO_DECAY_NAMES",
           "adopt_config_hyperparameters", "base_lr", "build_optimizer", "build_scheduler", "constant",
           "fused_supported", "implementation_default", "implementation_of", "optimizer_section", "param_groups",
           "restore_implementation", "scaled_lr", "scheduler_section", "trainable_only", "warmup_cosine",
           "warmup_linear"]

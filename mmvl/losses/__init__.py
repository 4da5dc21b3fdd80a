"""Registered losses (``losses:`` in a config) and the helpers the trainer applies them with.

One file a family: :mod:`.base` (the contract, build and apply), :mod:`.classification`,
:mod:`.contrastive` and :mod:`.tokens` (a generative model's answer-token loss). Importing the
package registers them all.
"""
from mmvl.labels import IGNORE_INDEX
from mmvl.losses.base import Loss, build_losses, compute_losses
from mmvl.losses.classification import CrossEntropyLoss, LogitBinaryCrossEntropy, SoftLabelCrossEntropy
from mmvl.losses.contrastive import ClipLoss, ContrastiveLoss, SigLipLoss
from mmvl.losses.tokens import AnswerTokensLoss, answer_token_count

__all__ = ["IGNORE_INDEX", "AnswerTokensLoss", "ClipLoss", "ContrastiveLoss", "CrossEntropyLoss",
           "LogitBinaryCrossEntropy", "Loss", "SigLipLoss", "SoftLabelCrossEntropy", "answer_token_count",
           "build_losses", "compute_losses"]

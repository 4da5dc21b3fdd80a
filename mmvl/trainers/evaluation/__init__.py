"""Evaluation: the run's one :class:`Evaluator` (:mod:`.evaluator`), and what it is made of: which
rows a rank owns (:mod:`.rows`), decoding and its cap (:mod:`.decoding`), loss sums (:mod:`.sums`),
progress (:mod:`.progress`) and the best validation value (:mod:`.best`)."""
from mmvl.trainers.evaluation.best import BestTracker
from mmvl.trainers.evaluation.evaluator import Evaluator, as_metric, check_metrics, prepare_split

__all__ = ["BestTracker", "Evaluator", "as_metric", "check_metrics", "prepare_split"]

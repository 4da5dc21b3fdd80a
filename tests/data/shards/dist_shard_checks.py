"""Run on each rank by test_shard_ranks.py (module-level, so dist_launch can start it in fresh processes)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def epoch_ids(env: Any, root: str, pattern: str, vocab: str) -> dict[str, Any]:
    """This rank's sample ids of two epochs, streamed with two DataLoader workers."""
    import multiprocessing

    multiprocessing.current_process().daemon = False  # the launcher's ranks are daemons; a rank may have workers
    from omegaconf import OmegaConf

    import mmvl.data.datasets  # noqa: F401
    from mmvl.data.shard_stream import train_stream
    from mmvl.registry import DATASETS

    cfg = OmegaConf.load(Path(__file__).resolve().parents[3] / "configs/datasets/image_text_shards.yaml")
    cfg = OmegaConf.merge(cfg, {"dataset_config": {"image_text_shards": {
        "image_size": 8, "shuffle_buffer": 4, "splits": {"train": {"shards": pattern}},
        "processors": {"text_processor": {"params": {"tokenizer_path": vocab, "max_seq_length": 8}}}}}})
    b = DATASETS.get("image_text_shards")(cfg.dataset_config.image_text_shards, root)
    s = train_stream(b.build("train"), batch_size=3, collate_fn=b.collate, seed=5, rank=env.rank,
                     world_size=env.world_size, num_workers=2, persistent_workers=True)  # one start per rank
    epochs = []
    for _ in range(2):
        batches = [next(s)["id"].tolist() for _ in range(s._plan.per_rank)]
        epochs.append(batches)
    return {"epochs": epochs, "per_rank": s.batches_per_epoch}

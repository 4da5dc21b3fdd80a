"""Opening a Hugging Face dataset's split on disk for ``hf_dataset``: which files, which split name,
which columns, and every way it can be wrong as one line. ``datasets`` is imported here, only when a
split is opened. Rows are read from the Arrow table as they are (:func:`arrow_row`): no column is
cast or rewritten, so opening a split costs no copy of it."""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any, Mapping

from mmvl.data.datasets._common import data_path
from mmvl.errors import UserError, first_line, library_input

#: each task's keys (the default column names; ``columns`` maps them to the dataset's)
TASKS = {"conversation": ("images", "texts"), "vqa": ("image", "question", "answer"), "caption": ("image", "caption"),
         "classification": ("image", "text", "label"), "contrastive": ("image", "caption")}
#: the tasks whose text is generated (the prompt_answer text processor) and those a classifier or a
#: two-tower model reads (any other text processor); vqa is either
GENERATED, READ = ("conversation", "caption"), ("classification", "contrastive")
#: the split names tried for mmvl's split when ``splits.<split>`` is null
DEFAULT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid"), "test": ("test",)}
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
INSTALL = "pip install 'mmvl[hf]' (datasets and pyarrow)"


def source_files(cfg: Mapping[str, Any], split: str, data_dir: str) -> list[Path]:
    """The files ``split`` is read from (what its caches are keyed by); refused when there are none."""
    path, files = cfg.get("path"), (cfg.get("data_files") or {})
    if path and any(files.values()):
        raise UserError("hf_dataset: path and data_files are both set; give one (a save_to_disk folder, or parquet "
                        "globs per split).")
    if path:
        folder = data_path(data_dir, None, path)
        if not folder.is_dir():
            hint = (f"it looks like a hub name: download it first (datasets.load_dataset({str(path)!r})"
                    ".save_to_disk(FOLDER), or its parquet files) and give the folder; nothing downloads at run time"
                    if _HUB_NAME.match(str(path)) and not folder.exists() else "give a save_to_disk folder")
            raise UserError(f"hf_dataset: path={str(path)!r} is not a folder; {hint}.")
        return sorted(p for p in folder.rglob("*") if p.is_file())
    key = files_key(cfg, split)
    pattern = files.get(key)
    if not pattern:
        if key != split:
            raise UserError(f"hf_dataset: splits.{split}={key!r} names data_files.{key}, which is not set (data_files has "
                            f"{', '.join(k for k, v in files.items() if v) or 'nothing'}); set it or fix splits.{split}.")
        raise UserError(f"hf_dataset: the run uses the {split} split and neither path nor data_files.{split} is set; "
                        f"set dataset_config.hf_dataset.path or data_files.{split} (a parquet glob), or change run_type.")
    full = str(data_path(data_dir, None, pattern))
    matched = sorted(Path(p) for p in glob.glob(full) if os.path.isfile(p))
    if not matched:
        raise UserError(f"hf_dataset: data_files.{key}={str(pattern)!r} matches no file ({full}); check the glob.")
    return matched


def files_key(cfg: Mapping[str, Any], split: str) -> str:
    """The ``data_files`` key mmvl's ``split`` reads: ``splits.<split>`` when set (as for a folder's
    split names, and as ``datasets.load_dataset("parquet", data_files=...)`` names splits by those
    keys), else the split's own name."""
    named = (cfg.get("splits") or {}).get(split)
    return str(named) if named else split


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(f"hf_dataset needs the datasets package: {INSTALL}.") from None
    return datasets


def open_split(cfg: Mapping[str, Any], split: str, data_dir: str, cache: str, columns: Mapping[str, str],
               task: str) -> Any:
    """``split`` as a memory-mapped ``datasets.Dataset``, its task's columns checked."""
    datasets = _import_datasets()
    files = source_files(cfg, split, data_dir)
    named = (cfg.get("splits") or {}).get(split)
    if cfg.get("path"):
        folder = data_path(data_dir, None, cfg["path"])
        with library_input(f"hf_dataset: path={str(folder)!r} does not load", "give a folder written by save_to_disk."):
            loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            names = [named] if named else [n for n in DEFAULT_NAMES[split] if n in loaded] or [split]
            if names[0] not in loaded:
                raise UserError(f"hf_dataset: {str(folder)!r} has no split {names[0]!r} (it has {', '.join(loaded)}); "
                                f"map mmvl's {split} split with dataset_config.hf_dataset.splits.{split}.")
            data = loaded[names[0]]
        elif split == "train" and not named:
            data = loaded
        else:
            raise UserError(f"hf_dataset: {str(folder)!r} holds one Dataset, which serves the train split only; save "
                            f"a DatasetDict with a {split} split, or change run_type.")
    else:
        key = files_key(cfg, split)
        check_parquet(files, key)
        with library_input(f"hf_dataset: data_files.{key} ({len(files)} files) does not load as parquet",
                           "give parquet files (e.g. written by Dataset.to_parquet)."):
            try:
                data = datasets.load_dataset("parquet", data_files={"rows": [str(p) for p in files]}, split="rows",
                                             cache_dir=cache)
            except datasets.exceptions.DatasetGenerationError as e:  # its own line says nothing: say its cause's
                raise ValueError(first_line(e.__cause__ or e)) from e
    missing = [f"{key} -> {columns[key]!r}" for key in TASKS[task] if columns[key] not in data.column_names]
    if missing:
        raise UserError(f"hf_dataset {split}: task {task} reads column(s) {', '.join(missing)}, and the dataset has "
                        f"{', '.join(data.column_names)}; map them with dataset_config.hf_dataset.columns.")
    return data


def check_parquet(files: list[Path], key: str) -> None:
    """Every file's parquet footer reads (a shard cut short, or not parquet at all, is named here
    instead of failing half-way through the conversion to Arrow)."""
    import pyarrow.parquet as pq

    for path in files:
        try:
            pq.ParquetFile(str(path)).close()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise UserError(f"hf_dataset: data_files.{key}: {str(path)!r} is not a readable parquet file "
                            f"({first_line(e)}); re-write it (Dataset.to_parquet) or drop it from the glob.") from None


def arrow_row(rows: Any, index: int) -> dict[str, Any]:
    """Row ``index`` of ``rows`` (a split's ``with_format("arrow")`` view, made once per split) as
    plain values read from the memory-mapped table, nothing decoded (an image is its ``{"bytes",
    "path"}`` cell): mmvl decodes images itself, naming a cell that fails."""
    return rows[int(index)].to_pylist()[0]


def image_cell(cell: Any) -> tuple[bytes | None, str | None]:
    """``(bytes, None)`` or ``(None, path)`` of an image cell: an undecoded ``datasets.Image``
    (``{"bytes", "path"}``), raw bytes, or a path string."""
    if isinstance(cell, Mapping):
        if cell.get("bytes"):
            return bytes(cell["bytes"]), None
        if cell.get("path"):
            return None, str(cell["path"])
    if isinstance(cell, (bytes, bytearray)):
        return bytes(cell), None
    if isinstance(cell, str) and cell:
        return None, cell
    raise UserError(f"hf_dataset: an image cell holds {type(cell).__name__} {str(cell)[:40]!r}; image columns hold "
                    "datasets.Image values, bytes or paths.")

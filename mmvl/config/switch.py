"""Choosing another ``type`` for a ``{type, params}`` component brings that type's parameters.

``optimizer.type=sgd`` on a config whose optimizer was ``adam_w`` keeps the parameters SGD takes
(``lr``, ``weight_decay``) and drops those it does not (``eps``), with one log line naming them;
what the new type takes but nobody set comes from its signature's defaults when it is built. A
parameter set on the command line that the new type refuses stays, so building it is the usual
one-line error: a value the user typed is never dropped silently. Types that were not switched
are left alone, so a misspelt parameter in a YAML still stops the run. The same holds for a
dataset's processors (``dataset_config.<name>.processors.<key>``), e.g. a ``prompt_answer`` text
processor switched to ``vocab`` for a classifier.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from mmvl import registry
from mmvl.config.access import ABSENT, lookup
from mmvl.config.components import accepted_keywords

log = logging.getLogger("mmvl")

#: config paths of switchable components: (registry kind, positional arguments before the params)
SWITCHABLE = {"optimizer": ("optimizer", 1), "scheduler": ("scheduler", 1)}


def adopt_switched_types(cfg: dict[str, Any], base: dict[str, Any], provenance: dict[str, str],
                         keep_from: str) -> list[str]:
    """Drop the params a switched component's new type refuses (unless set in ``keep_from``, the
    command line); returns the dropped dotted keys."""
    dropped: list[str] = []
    processors = {f"dataset_config.{name}.processors.{key}": ("processor", 0)
                  for name, section in (cfg.get("dataset_config") or {}).items() if isinstance(section, dict)
                  for key in (section.get("processors") or {})}
    for path, (kind, n_args) in {**SWITCHABLE, **processors}.items():
        node, before = lookup(cfg, path), lookup(base, path)
        if not isinstance(node, dict) or not node.get("type") or not isinstance(node.get("params"), dict):
            continue
        if before is not ABSENT and isinstance(before, dict) and before.get("type") == node["type"]:
            continue
        accepted, open_ = accepted_keywords(registry.ALL[kind].get(node["type"]), n_args)
        if open_:
            continue
        params = node["params"]
        refused = [k for k, v in params.items() if k not in accepted and v is not None
                   and provenance.get(f"{path}.params.{k}") != keep_from]
        for key in refused:
            del params[key]
        if refused and os.environ.get("RANK", "0") == "0":
            where = ", ".join(f"{k} (from {provenance.get(f'{path}.params.{k}', 'the defaults')})" for k in refused)
            log.warning("%s.type=%s does not take %s: dropped (it takes %s)", path, node["type"], where,
                     ", ".join(accepted))
        dropped += [f"{path}.params.{k}" for k in refused]
    return dropped

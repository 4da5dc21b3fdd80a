"""Put on PYTHONPATH by tests/docs/test_docs.py only: the tutorial's tiny settings.

With ``MMVL_DOCS_TINY`` (a JSON list of ``key=value``) set, ``mmvl.config.load_config``
gets those options placed *before* the caller's own, so a tutorial's command runs as
written but on tiny sizes, and any key the tutorial sets itself still wins; an option
written ``!key=value`` goes *after* them and wins over the page. The patch is
applied when ``mmvl.config.load`` is first imported (interpreters that never import mmvl
pay nothing), in every process: mmvl_run, python blocks, torchrun's workers.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
import sys

_TINY = json.loads(os.environ.get("MMVL_DOCS_TINY") or "[]")


class _TinyOptions:
    """A meta-path finder that wraps ``load_config`` right after its module executes."""

    def find_spec(self, name, path, target=None):
        if name != "mmvl.config.load":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            original = module.load_config

            def load_config(opts=(), *args, **kwargs):
                opts = opts.split() if isinstance(opts, str) else list(opts)
                before = [o for o in _TINY if not o.startswith("!")]
                after = [o[1:] for o in _TINY if o.startswith("!")]
                return original([*before, *opts, *after], *args, **kwargs)

            module.load_config = load_config

        spec.loader.exec_module = exec_module
        return spec


if _TINY:
    sys.meta_path.insert(0, _TinyOptions())

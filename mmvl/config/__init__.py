"""mmvl's configuration: OmegaConf YAML layers merged, validated and resolved.

``load_config(opts)`` merges ``configs/defaults.yaml`` -> the model's YAML ->
each dataset's YAML -> the user's ``config=`` file (with ``includes``) ->
command-line ``key=value`` overrides, and returns a fully resolved DictConfig.
"""
from __future__ import annotations

from mmvl.config.load import config_root, import_registrations, load_config, save_config
from mmvl.config.opts import ParsedOpts, parse_opts
from mmvl.config.resolvers import register_resolvers

register_resolvers()

__all__ = ["load_config", "save_config", "import_registrations", "parse_opts", "ParsedOpts", "config_root", "register_resolvers"]

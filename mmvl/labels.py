"""Label values that data, models and losses share; a leaf that imports nothing from mmvl.

Datasets write them, models read them and losses skip them: keeping them here lets data and
models name them without importing the loss registry.
"""

#: the label a masked-LM / token loss ignores (``torch.nn.functional.cross_entropy``'s default)
IGNORE_INDEX = -100

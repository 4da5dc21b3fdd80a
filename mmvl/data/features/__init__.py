"""Region/grid features: a pickle-free LMDB format, readers, converters and a grid extractor.

Importing this package registers the ``features`` processor.
"""
from mmvl.data.features.format import FeatureFormatError, FeatureRecord, decode, encode
from mmvl.data.features.lmdb_store import LMDBFeatureReader, LMDBFeatureWriter
from mmvl.data.features.npy import NpyFeatureReader
from mmvl.data.features.processor import FeaturesProcessor, open_features

__all__ = [
    "FeatureFormatError", "FeatureRecord", "FeaturesProcessor", "LMDBFeatureReader", "LMDBFeatureWriter",
    "NpyFeatureReader", "decode", "encode", "open_features",
]

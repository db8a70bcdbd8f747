from .layers import FlatModel, Layer, shaped
from .nets import CNN, DNN, MLR, build_model

__all__ = ["FlatModel", "Layer", "shaped", "CNN", "DNN", "MLR", "build_model"]

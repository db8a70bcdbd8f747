from .layers import FlatModel, Layer
from .nets import CNN, DNN, MLR, build_model

__all__ = ["FlatModel", "Layer", "CNN", "DNN", "MLR", "build_model"]

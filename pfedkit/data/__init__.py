from .federated import ClientData, FederatedData, build_federated
from .partition import Partition, make_partition
from .sources import Source, load_source

__all__ = ["ClientData", "FederatedData", "build_federated", "Partition", "make_partition", "Source", "load_source"]

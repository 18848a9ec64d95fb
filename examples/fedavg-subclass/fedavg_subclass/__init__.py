"""fedavg-subclass: a customised FedAvg strategy moved onto an asynchronous base class."""

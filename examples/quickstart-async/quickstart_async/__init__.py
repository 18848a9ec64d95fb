"""quickstart-async: Flower's PyTorch quickstart run by an asynchronous strategy."""

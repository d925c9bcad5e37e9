"""gonka-node: wires training, chain and protocol together (CLI, keys, host, aggregator, devnet)."""

__version__ = "0.1.0"

"""Which certificate a host trusts for its aggregator (gonka_node/core/discovery.py decides)."""

from __future__ import annotations

from chain.client import ChainClient
from gonka_node.core.discovery import AggregatorAddress, MissingPinError, resolve_aggregator
from gonka_node.host.config import HostConfig

__all__ = ["AggregatorAddress", "MissingPinError", "aggregator_pin"]


def aggregator_pin(cfg: HostConfig, chain: ChainClient, epoch: int) -> AggregatorAddress:
    """The aggregator the host dials and the PEM certificate its client trusts, and nothing else
    (gonka_node/core/tls.py): the file `[aggregator] tls_cert` names, else the certificate the aggregator
    announced on chain for the configured endpoint (`[host] aggregator`; empty: the one it announced)."""
    return resolve_aggregator(chain, epoch, cfg.aggregator or None, cfg.aggregator_tls_cert)

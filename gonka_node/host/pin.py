"""Which certificate a host trusts for its aggregator (gonka_node/discovery.py decides)."""

from __future__ import annotations

from chain.client import ChainClient
from gonka_node.discovery import MissingPinError, resolve_aggregator
from gonka_node.host.config import HostConfig

__all__ = ["MissingPinError", "aggregator_pin"]


def aggregator_pin(cfg: HostConfig, chain: ChainClient, epoch: int) -> bytes:
    """The PEM certificate the host's aggregator client trusts, and nothing else (gonka_node/tls.py): the
    file `[aggregator] tls_cert` names, else the certificate the aggregator announced on chain for the
    configured endpoint."""
    return resolve_aggregator(chain, epoch, cfg.aggregator, cfg.aggregator_tls_cert).tls_cert_pem

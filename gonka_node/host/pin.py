"""Which certificate a host trusts for its aggregator: the one place that decides.

Today the pin is the file `[aggregator] tls_cert` names (a copy of the aggregator's
`<data_dir>/tls/cert.pem`; the aggregator logs its sha256 at start). When that key is absent, this is
where the chain's announcement will be read: `ChainClient.aggregator_endpoints(epoch)` lists, per
aggregator account, its endpoint and certificate (PEM and sha256) as that account published them.
"""

from __future__ import annotations

from chain.client import ChainClient
from gonka_node.host.config import HostConfig
from gonka_node.tls import TlsError, load_certificate


class MissingPinError(TlsError):
    """No certificate to pin: the host would have nothing to check the aggregator against."""


def aggregator_pin(cfg: HostConfig, chain: ChainClient, epoch: int) -> bytes:
    """The PEM certificate the host's aggregator client trusts, and nothing else (gonka_node/tls.py).

    `chain` and `epoch` are where the announced certificate will come from when the config names none.
    """
    if cfg.aggregator_tls_cert is not None:
        return load_certificate(cfg.aggregator_tls_cert)
    raise MissingPinError(
        f"[aggregator] tls_cert is not set, and epoch {epoch}'s aggregator certificate cannot be read from "
        "the chain yet: copy the aggregator's <data_dir>/tls/cert.pem and name it there"
    )

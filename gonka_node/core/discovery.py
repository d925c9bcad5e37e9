"""Where an epoch's aggregator is and which TLS certificate it has: the one place that decides.

An aggregator announces, from its account, its gRPC endpoint and its certificate's PEM on chain
(`Registry.announce_aggregator`; the contract keeps the certificate's sha256 and the client checks the
announced PEM against it), so a host or client that trusts the chain needs no file handed to it. A
certificate file given explicitly (`[aggregator] tls_cert`, `--tls-cert`) overrides the chain: for an
aggregator that has not announced, or a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gonka_node.core.tls import TlsError, load_certificate


class MissingPinError(TlsError):
    """No certificate to pin: nothing to check the aggregator against."""


@dataclass(frozen=True)
class AggregatorAddress:
    target: str  # host:port
    tls_cert_pem: bytes
    source: str  # where the pin came from, for messages


def resolve_aggregator(chain: Any, epoch: int, target: str | None, cert_file: Path | None) -> AggregatorAddress:
    """The aggregator to dial and the certificate to trust. `target` None: the first one the epoch's
    aggregators announced; `cert_file` None: the certificate announced on chain for `target`."""
    if cert_file is not None:
        if target is None:
            raise MissingPinError("a certificate file was given without the aggregator's HOST:PORT")
        return AggregatorAddress(target, load_certificate(cert_file), str(cert_file))
    announced = chain.aggregator_endpoints(epoch)
    if not announced:
        raise MissingPinError(
            f"no aggregator of epoch {epoch} has announced its endpoint and certificate on chain yet: give the "
            "aggregator's certificate file (its <data_dir>/tls/cert.pem) and HOST:PORT instead"
        )
    chosen = announced[0] if target is None else next((a for a in announced if a.endpoint == target), None)
    if chosen is None:
        listed = ", ".join(f"{a.endpoint} ({a.address})" for a in announced)
        raise MissingPinError(
            f"{target} is not an endpoint epoch {epoch}'s aggregators announced on chain (they announced: "
            f"{listed}); use one of those, or give that aggregator's certificate file"
        )
    return AggregatorAddress(chosen.endpoint, chosen.tls_cert_pem, f"the chain (announced by {chosen.address})")

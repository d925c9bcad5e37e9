"""The aggregator: authenticate, stream, validate, score and robustly combine hosts' pseudo-gradients,
then apply the outer step, save the checkpoint and finalize the round on chain (docs/PROTOCOL.md)."""

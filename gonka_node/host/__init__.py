"""The host daemon: sign in to an epoch, train each round, submit, follow the global model, get paid."""

"""The foundations every other part of `gonka_node` builds on: settings (`config`, `recipe`), the signed
wire format (`envelope`, `wire`), identities (`keys`, `tls`), object storage (`storage`) and link shaping
(`link`). They import only `training`, `chain`, `proto` and each other, never the aggregator, the host,
the CLI or the devnet (tests/gonka_node/test_layers.py checks it)."""

"""Recipes and aggregator endpoints published on chain, read back and checked, on both backends."""

from __future__ import annotations

import hashlib
import json

import pytest
from conftest import World, reverts

from chain.types import AggregatorEndpoint

RECIPE = json.dumps({"format": "gonka-recipe-v1", "inner_steps": 50}, sort_keys=True, separators=(",", ":")).encode()
CERT_A = b"-----BEGIN CERTIFICATE-----\nMIIBaggregatorA\n-----END CERTIFICATE-----\n"
CERT_B = b"-----BEGIN CERTIFICATE-----\nMIIBaggregatorB\n-----END CERTIFICATE-----\n"


def test_only_the_recipe_that_hashes_to_model_spec_hash_is_published(world: World) -> None:
    gov = world.client(0)
    epoch = gov.create_epoch(world.spec(model_spec_hash=hashlib.sha256(RECIPE).digest()))
    stranger = world.client(9)
    assert stranger.published_recipe(epoch) is None
    with reverts("registry: recipe does not hash to the epoch's model_spec_hash"):
        stranger.publish_recipe(epoch, RECIPE + b" ")
    with reverts("registry: unknown epoch"):
        stranger.publish_recipe(epoch + 1, RECIPE)
    stranger.publish_recipe(epoch, RECIPE)  # anyone may publish it
    assert gov.published_recipe(epoch) == RECIPE
    with pytest.raises(ValueError, match="recipe_json is 8193 bytes"):
        stranger.publish_recipe(epoch, b"x" * 8193)


def test_aggregator_endpoints_are_the_latest_announcements(world: World) -> None:
    gov = world.client(0)
    aggregators = (world.address(1), world.address(5), world.address(6))
    epoch = gov.create_epoch(world.spec(aggregators=aggregators))
    with reverts("registry: not an aggregator of this epoch"):
        world.client(9).announce_aggregator(epoch, "stranger.example:443", CERT_A)
    with reverts("registry: empty tls_cert"):
        world.client(1).announce_aggregator(epoch, "agg1.example:443", b"")
    assert gov.aggregator_endpoints(epoch) == []
    world.client(1).announce_aggregator(epoch, "agg1.example:50051", CERT_A)
    world.client(5).announce_aggregator(epoch, "agg5.example:50051", CERT_A)
    world.client(1).announce_aggregator(epoch, "agg1.example:443", CERT_B)  # moved, new certificate
    assert gov.aggregator_endpoints(epoch) == [
        AggregatorEndpoint(world.address(1), "agg1.example:443", CERT_B, hashlib.sha256(CERT_B).digest()),
        AggregatorEndpoint(world.address(5), "agg5.example:50051", CERT_A, hashlib.sha256(CERT_A).digest()),
    ]  # aggregator 6 never announced
    gov.set_aggregators(epoch, [world.address(5)], 1)
    assert [e.address for e in gov.aggregator_endpoints(epoch)] == [world.address(5)]

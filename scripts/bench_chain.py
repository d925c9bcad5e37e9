#!/usr/bin/env python3
"""Gas of every Registry/GNK/Governor call, of finalizing a round whose reward tree holds 4, 64 and
1,024 hosts, and of a claim with a proof from the 1,024-leaf tree.

    .venv/bin/python scripts/bench_chain.py [--rpc-url http://127.0.0.1:8545] [--out gas.json]

Gas is read from receipts (gasUsed), so it is the same on the embedded EVM and on anvil. Finalizing
reads no per-host state: its gas must not grow with the number of hosts (the script checks it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, cast

from hexbytes import HexBytes
from web3.types import BlockIdentifier, TxReceipt

from chain.backends import ChainBackend, EmbeddedBackend, RpcBackend
from chain.client import ChainClient
from chain.merkle import RewardTree
from chain.seed import seed_commitment
from chain.types import EpochSpec
from chain.units import NGONKA_PER_GNK as GNK

TREE_SIZES = (4, 64, 1024)
RECIPE = b"r" * 1024  # stands for a recipe's canonical JSON: publish_recipe checks its sha256


def sha(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def spec(aggregator: str, max_hosts: int) -> EpochSpec:
    return EpochSpec(
        model_spec_hash=hashlib.sha256(RECIPE).digest(), model_uri="https://example.org/llama-tiny.json",
        data_manifest_hash=sha("data"), init_checkpoint_hash=sha("ckpt-0"), inner_steps=50, inner_lr=3e-4,
        batch_size=8, outer_lr=0.7, outer_momentum=0.9, codec="topk-int8", n_rounds=10, round_length=600,
        signin_window=3600, min_stake=8000 * GNK, max_hosts=max_hosts, aggregators=(aggregator,),
        reward_per_round=2000 * GNK, replay_probability=0.25,
    )


def first_receipt(client: ChainClient, block: BlockIdentifier) -> TxReceipt:
    """The receipt of the block's first transaction (each block here holds one)."""
    tx = client.w3.eth.get_block(block)["transactions"][0]
    return client.w3.eth.get_transaction_receipt(cast(HexBytes, tx))  # hashes: full_transactions is off


def run(backend: ChainBackend) -> dict[str, Any]:
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[0]).connect()
    gas: dict[str, int] = {}

    def record(name: str, receipt: TxReceipt) -> None:
        gas[name] = int(receipt["gasUsed"])

    block = gov.w3.eth.block_number
    gov.deploy_all()
    for n in range(block + 1, gov.w3.eth.block_number + 1):
        record(f"deploy {('GNK', 'Governor', 'Registry')[n - block - 1]}", first_receipt(gov, n))
    host, agg = gov.with_account(accounts[2]), gov.with_account(accounts[1])
    record("mint", gov.mint(host.address, 1_000_000 * GNK))
    gov.mint(gov.address, 1_000_000 * GNK)
    record("create_epoch", gov.transact(gov.registry, "create_epoch", spec(agg.address, 1024).to_abi()))
    epoch = gov.epoch_count()
    record("approve", gov.approve(gov.registry.address, 10**30))
    record("fund_epoch", gov.fund_epoch(epoch, 100_000 * GNK))
    record("set_aggregators", gov.set_aggregators(epoch, [agg.address, accounts[3].address], 1))
    host.approve(gov.registry.address, 10**30)
    record("join", host.transact(host.registry, "join", epoch, 8000 * GNK, sha("node-key")))
    leaver = gov.with_account(accounts[4])
    gov.mint(leaver.address, 10_000 * GNK)
    leaver.join(epoch, 8000 * GNK, sha("leaver-key"))
    record("leave", leaver.leave(epoch))
    record("slash", gov.slash(epoch, host.address, GNK, sha("evidence")))
    record("publish_recipe (1 KiB)", gov.transact(gov.registry, "publish_recipe", epoch, RECIPE))
    record("announce_aggregator (1.2 KB certificate)", agg.announce_aggregator(epoch, "agg.example:443", b"c" * 1200))
    record("challenge", gov.transact(gov.registry, "challenge", epoch, host.address, sha("e"), "ipfs://evidence"))
    record("resolve_challenge (rejected)", gov.resolve_challenge(1, False))
    gov.transact(gov.registry, "challenge", epoch, host.address, sha("e"), "ipfs://evidence")
    record("vote_challenge (upholds: slashes, pays)", agg.vote_challenge(2, True))
    backend.increase_time(3601)
    record("commit_round_seed", agg.commit_round_seed(epoch, 1, seed_commitment(sha("secret"))))
    record("reveal_round_seed", agg.reveal_round_seed(epoch, 1, sha("secret")))

    # Each size finalizes the same round 1 from the same state (snapshot/revert), so only the tree
    # differs; the last (1,024) stays for the claim.
    finalize: dict[str, int] = {}
    for size in TREE_SIZES:
        snapshot = backend.snapshot()
        rewards = [(host.address, 50 * GNK)] + [(f"0x{i:040x}", GNK + i) for i in range(1, size)]
        tree = RewardTree(gov.chain_id, gov.registry.address, epoch, 1, rewards)
        receipt = agg.finalize_round(epoch, 1, sha("ckpt-1"), tree.root, size, tree.total)
        finalize[str(size)] = int(receipt["gasUsed"])
        if size != TREE_SIZES[-1]:
            backend.revert(snapshot)
    proof = tree.proof(host.address)
    claim_receipt = host.claim(epoch, 1, tree.amount(host.address), proof)
    gas["claim (1024-leaf tree)"] = int(claim_receipt["gasUsed"])
    gas["finalize_round"] = finalize["1024"]

    # Governance through the Governor: deposit, propose, vote, execute (creates an epoch).
    governed = ChainClient(backend, accounts[0]).connect()
    governed.deploy_all(use_governor=True, voting_period_s=3600, quorum_bps=1000,
                        initial_mint={accounts[5].address: 1_000_000 * GNK})
    voter = governed.with_account(accounts[5])
    record("governor deposit", voter.gov_deposit(1_000_000 * GNK))
    pid = voter.propose([voter.action_create_epoch(spec(agg.address, 64))], "bench")
    record("governor propose (create_epoch)", first_receipt(voter, "latest"))
    record("governor vote", voter.vote(pid, True))
    backend.increase_time(3601)
    record("governor execute (create_epoch)", voter.execute(pid))

    backend.increase_time(10 * 600 + 3600)  # the rounds' deadline, then the challenge window
    record("withdraw_stake", gov.with_account(accounts[4]).transact(gov.registry, "withdraw_stake", epoch))
    return {
        "backend": backend.name,
        "chain_id": gov.chain_id,
        "gas": gas,
        "finalize_gas": finalize,
        "claim_gas": gas["claim (1024-leaf tree)"],
        "claim_proof_length": len(proof),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpc-url", help="benchmark on this node (default: the embedded EVM)")
    parser.add_argument("--out", type=Path, help="write the results as one JSON object")
    args = parser.parse_args(argv)
    backend: ChainBackend = RpcBackend(args.rpc_url) if args.rpc_url else EmbeddedBackend()
    result = run(backend)
    width = max(len(k) for k in result["gas"])
    for name, used in result["gas"].items():
        print(f"{name:<{width}}  {used:>9,} gas")
    for size, used in result["finalize_gas"].items():
        print(f"{'finalize_round, ' + size + ' hosts':<{width}}  {used:>9,} gas")
    spread = max(result["finalize_gas"].values()) - min(result["finalize_gas"].values())
    print(f"finalize spread across tree sizes: {spread} gas (calldata bytes only)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    # Flat: any growth beyond calldata noise (16 gas per non-zero byte of two words) is a regression.
    return 0 if spread <= 1024 else 1


if __name__ == "__main__":
    sys.exit(main())

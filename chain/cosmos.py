"""Gonka's Cosmos side: `gonka1…` addresses, signed `ngonka` payouts, balance queries.

Gonka's own chain is a Cosmos SDK chain (bech32 prefix `gonka`, denom `ngonka`, 1 GNK = 10^9 ngonka).
Rewards earned on our EVM books can be paid out there; this module builds the transactions.

Address derivation. One secp256k1 private key can back both an EVM account and a Cosmos account, but the
two chains hash its public key differently:
  EVM:    keccak256(uncompressed 64-byte public key)[12:]          -> 0x…  (20 bytes)
  Cosmos: ripemd160(sha256(compressed 33-byte public key))          -> gonka1… (20 bytes, bech32)
so the two addresses of one key share no bytes, and neither can be computed from the other; only from the
public key. Gonka uses plain Cosmos `secp256k1` keys (not Ethermint's `eth_secp256k1`), hence the
ripemd160 form. Wallets derive Gonka keys from a mnemonic at BIP-44 path m/44'/1200'/0'/0/0
(`COIN_TYPE`), EVM wallets at m/44'/60'/0'/0/0: the same mnemonic gives two different private keys. We
use the raw EVM private key directly, so the `gonka1…` address shown here is *not* the one Keplr shows
for the mnemonic that produced the EVM key.

Transactions are signed with SIGN_MODE_DIRECT: the signature is ECDSA over sha256(SignDoc), SignDoc being
(body_bytes, auth_info_bytes, chain_id, account_number); low-S, 64 bytes r||s. The result is a `TxRaw`
ready for `BroadcastTx`.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from typing import Any

import bech32
import grpc
from cosmpy.aerial.client import LedgerClient, NetworkConfig
from cosmpy.crypto.keypairs import PrivateKey
from cosmpy.protos.cosmos.auth.v1beta1.auth_pb2 import BaseAccount
from cosmpy.protos.cosmos.auth.v1beta1.query_pb2 import QueryAccountRequest
from cosmpy.protos.cosmos.bank.v1beta1.query_pb2 import QueryBalanceRequest
from cosmpy.protos.cosmos.bank.v1beta1.tx_pb2 import MsgSend
from cosmpy.protos.cosmos.base.v1beta1.coin_pb2 import Coin
from cosmpy.protos.cosmos.crypto.secp256k1.keys_pb2 import PubKey
from cosmpy.protos.cosmos.tx.signing.v1beta1.signing_pb2 import SignMode
from cosmpy.protos.cosmos.tx.v1beta1.tx_pb2 import (
    AuthInfo,
    Fee,
    ModeInfo,
    SignDoc,
    SignerInfo,
    TxBody,
    TxRaw,
)
from google.protobuf.any_pb2 import Any as ProtoAny

BECH32_PREFIX = "gonka"
DENOM = "ngonka"
COIN_TYPE = 1200  # BIP-44 coin type of Gonka wallets (m/44'/1200'/0'/0/0)
UINT64_MAX = 2**64 - 1
SECP256K1_ORDER = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
MAX_CHAIN_ID_LEN = 50  # CometBFT rejects longer chain ids
MAX_MEMO_CHARS = 256  # x/auth's default MaxMemoCharacters
# Account addresses are 20 bytes; module-derived ones (ICA, contracts) 32. Nothing else is a payee.
_ADDRESS_LENGTHS = (20, 32)


class CosmosError(Exception):
    """Base of every error raised by the Cosmos side."""


class CosmosAddressError(CosmosError, ValueError):
    """A `gonka1…` address that is malformed, has a bad checksum, or the wrong prefix or length."""


class CosmosAmountError(CosmosError, ValueError):
    """An amount that is not a positive integer of ngonka fitting in uint64."""


class CosmosTxError(CosmosError, ValueError):
    """A transaction field (chain id, sequence, gas, memo, key) out of range."""


class CosmosQueryError(CosmosError):
    """A query that could not be answered: no node configured, node unreachable or slow, bad answer."""


# ---------------------------------------------------------------------------------------------- addresses


def address_from_public_key(compressed_public_key: bytes, prefix: str = BECH32_PREFIX) -> str:
    """bech32(prefix, ripemd160(sha256(33-byte compressed secp256k1 public key)))."""
    if len(compressed_public_key) != 33 or compressed_public_key[0] not in (2, 3):
        raise CosmosAddressError(
            f"expected a 33-byte compressed secp256k1 public key, got {len(compressed_public_key)} bytes"
        )
    digest = hashlib.new("ripemd160", hashlib.sha256(compressed_public_key).digest()).digest()
    return _bech32_encode(prefix, digest)


def parse_address(address: str, prefix: str = BECH32_PREFIX) -> bytes:
    """Check a bech32 account address and return its raw bytes; each defect gets its own message."""
    if not isinstance(address, str) or not address:
        raise CosmosAddressError(f"address must be a non-empty string, got {address!r}")
    if address != address.lower() and address != address.upper():
        raise CosmosAddressError(f"address {address!r} mixes upper and lower case")
    lowered = address.lower()
    hrp, sep, data = lowered.rpartition("1")
    if not sep or not hrp:
        raise CosmosAddressError(f"address {address!r} has no bech32 prefix/separator")
    bad = sorted({c for c in data if c not in bech32.CHARSET})
    if bad:
        raise CosmosAddressError(f"address {address!r} contains characters outside bech32: {''.join(bad)!r}")
    if hrp != prefix:
        raise CosmosAddressError(f"address {address!r} has prefix {hrp!r}, expected {prefix!r}")
    decoded_hrp, words = bech32.bech32_decode(lowered)
    if decoded_hrp is None or words is None:
        raise CosmosAddressError(f"address {address!r} fails its bech32 checksum (mistyped?)")
    raw = bech32.convertbits(words, 5, 8, False)
    if raw is None or len(raw) not in _ADDRESS_LENGTHS:
        length = "invalid padding" if raw is None else f"{len(raw)} bytes"
        raise CosmosAddressError(f"address {address!r} decodes to {length}, expected 20 or 32 bytes")
    return bytes(raw)


def _bech32_encode(prefix: str, raw: bytes) -> str:
    words = bech32.convertbits(raw, 8, 5, True)
    assert words is not None  # convertbits only fails on padding when decoding
    return bech32.bech32_encode(prefix, words)


# ---------------------------------------------------------------------------------------------- amounts


def check_amount(amount_ngonka: int, what: str = "amount", *, allow_zero: bool = False) -> int:
    """An ngonka amount: an int (not bool, not float), positive (or zero if allowed), at most uint64."""
    if isinstance(amount_ngonka, bool) or not isinstance(amount_ngonka, int):
        raise CosmosAmountError(f"{what} must be an integer number of ngonka, got {amount_ngonka!r}")
    if amount_ngonka < 0 or (amount_ngonka == 0 and not allow_zero):
        bound = "≥ 0" if allow_zero else "> 0"
        raise CosmosAmountError(f"{what} must be {bound} ngonka, got {amount_ngonka}")
    if amount_ngonka > UINT64_MAX:
        raise CosmosAmountError(f"{what} {amount_ngonka} ngonka overflows uint64 (max {UINT64_MAX})")
    return amount_ngonka


def gnk_to_ngonka(amount_gnk: str | Decimal) -> int:
    """A GNK amount ("1.5") in ngonka (1_500_000_000); finer than 1 ngonka is an error, never rounded."""
    if isinstance(amount_gnk, str) and len(amount_gnk) > 40:
        raise CosmosAmountError(f"GNK amount {amount_gnk[:40]!r}… is too long to be a real amount")
    try:
        value = Decimal(amount_gnk)
    except (InvalidOperation, TypeError, ValueError) as exc:
        raise CosmosAmountError(f"GNK amount {amount_gnk!r} is not a decimal number") from exc
    if not value.is_finite():
        raise CosmosAmountError(f"GNK amount {amount_gnk!r} is not finite")
    with localcontext() as ctx:
        ctx.prec = 100  # the default 28 digits would round 29-digit inputs silently
        scaled = value.scaleb(9)
    if scaled != scaled.to_integral_value():
        raise CosmosAmountError(f"GNK amount {amount_gnk!r} has more than 9 decimals (1 ngonka = 1e-9 GNK)")
    return check_amount(int(scaled), f"GNK amount {amount_gnk!r}")


def _check_uint64(value: int, what: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= UINT64_MAX:
        raise CosmosTxError(f"{what} must be an integer in [{minimum}, 2^64-1], got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- payouts


@dataclass(frozen=True)
class Payout:
    """One MsgSend of `amount_ngonka` to `recipient` (a gonka1… address)."""

    recipient: str
    amount_ngonka: int


@dataclass(frozen=True)
class TxParams:
    """Everything a signature commits to besides the messages; validated on construction."""

    chain_id: str
    account_number: int
    sequence: int
    gas_limit: int
    fee_ngonka: int
    memo: str = ""
    timeout_height: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.chain_id, str) or not 0 < len(self.chain_id) <= MAX_CHAIN_ID_LEN:
            raise CosmosTxError(f"chain_id must be 1..{MAX_CHAIN_ID_LEN} characters, got {self.chain_id!r}")
        _check_uint64(self.account_number, "account_number")
        _check_uint64(self.sequence, "sequence")
        _check_uint64(self.gas_limit, "gas_limit", minimum=1)
        _check_uint64(self.timeout_height, "timeout_height")
        check_amount(self.fee_ngonka, "fee", allow_zero=True)
        if len(self.memo) > MAX_MEMO_CHARS:
            raise CosmosTxError(f"memo is {len(self.memo)} characters, the chain accepts {MAX_MEMO_CHARS}")


@dataclass(frozen=True)
class SignedTx:
    """A signed `TxRaw` and what identifies it."""

    tx_raw: bytes
    tx_hash: str  # sha256(tx_raw), upper-case hex, as Cosmos explorers show it
    sender: str
    total_ngonka: int


class CosmosAccount:
    """A secp256k1 key seen as a Cosmos account. Holds the private key; its repr shows only the address."""

    def __init__(self, private_key: bytes, prefix: str = BECH32_PREFIX) -> None:
        if not isinstance(private_key, bytes) or len(private_key) != 32:
            raise CosmosTxError("a secp256k1 private key is exactly 32 bytes")
        if not 0 < int.from_bytes(private_key, "big") < SECP256K1_ORDER:
            raise CosmosTxError("secp256k1 private key out of range (zero or ≥ the group order)")
        self._key = PrivateKey(private_key)
        self.prefix = prefix
        self.public_key: bytes = self._key.public_key.public_key_bytes  # 33 bytes, compressed
        self.address: str = address_from_public_key(self.public_key, prefix)

    def __repr__(self) -> str:
        return f"CosmosAccount(address={self.address!r})"

    def sign_payouts(self, payouts: Sequence[Payout], params: TxParams) -> SignedTx:
        """One transaction with one MsgSend of ngonka per payout, signed in SIGN_MODE_DIRECT."""
        messages = self._payout_messages(payouts)
        body = TxBody(messages=messages, memo=params.memo, timeout_height=params.timeout_height)
        auth_info = AuthInfo(
            signer_infos=[
                SignerInfo(
                    public_key=_pack(PubKey(key=self.public_key)),
                    mode_info=ModeInfo(single=ModeInfo.Single(mode=SignMode.SIGN_MODE_DIRECT)),
                    sequence=params.sequence,
                )
            ],
            fee=Fee(amount=_coins(params.fee_ngonka), gas_limit=params.gas_limit),
        )
        # Serialize once: these exact bytes are what gets signed and what goes on the wire.
        body_bytes = body.SerializeToString(deterministic=True)
        auth_info_bytes = auth_info.SerializeToString(deterministic=True)
        sign_doc = SignDoc(
            body_bytes=body_bytes,
            auth_info_bytes=auth_info_bytes,
            chain_id=params.chain_id,
            account_number=params.account_number,
        ).SerializeToString(deterministic=True)
        # RFC 6979 nonces: the same inputs give the same bytes; low-S, as the SDK's ante handler demands.
        signature = self._key.sign(sign_doc, deterministic=True, canonicalise=True)
        tx_raw = TxRaw(
            body_bytes=body_bytes, auth_info_bytes=auth_info_bytes, signatures=[signature]
        ).SerializeToString(deterministic=True)
        return SignedTx(
            tx_raw=tx_raw,
            tx_hash=hashlib.sha256(tx_raw).hexdigest().upper(),
            sender=self.address,
            total_ngonka=sum(p.amount_ngonka for p in payouts),
        )

    def _payout_messages(self, payouts: Sequence[Payout]) -> list[ProtoAny]:
        if not payouts:
            raise CosmosTxError("no payouts given: a transaction needs at least one MsgSend")
        seen: set[bytes] = set()
        messages = []
        for i, payout in enumerate(payouts):
            raw = parse_address(payout.recipient, self.prefix)
            check_amount(payout.amount_ngonka, f"payout #{i} ({payout.recipient}) amount")
            if raw in seen:
                # Payout lists are per recipient; a repeat is almost surely a double payment.
                raise CosmosTxError(f"payout #{i}: recipient {payout.recipient} appears twice")
            seen.add(raw)
            messages.append(
                _pack(
                    MsgSend(
                        from_address=self.address,
                        to_address=payout.recipient.lower(),
                        amount=_coins(payout.amount_ngonka),
                    )
                )
            )
        return messages


def _coins(amount_ngonka: int) -> list[Coin]:
    # A zero fee is an empty coin list: the SDK rejects zero-amount coins in sdk.Coins.
    return [Coin(denom=DENOM, amount=str(amount_ngonka))] if amount_ngonka else []


def _pack(message: object) -> ProtoAny:
    packed = ProtoAny()
    packed.Pack(message, type_url_prefix="/")  # Cosmos type URLs are "/pkg.Msg"
    return packed


# ---------------------------------------------------------------------------------------------- queries


_URL_SCHEMES = ("grpc+http://", "grpc+https://", "rest+http://", "rest+https://")
_MAX_REST_ANSWER = 64 * 1024  # balance and account answers are tiny; never read unbounded


@dataclass(frozen=True)
class AccountInfo:
    """What a signer needs from the chain: `TxParams.account_number` and the next `sequence`."""

    account_number: int
    sequence: int


class CosmosQuery:
    """Balance and account queries against a Gonka node, bounded in time.

    `url` is `grpc+http(s)://host:port` (served through cosmpy's LedgerClient) or `rest+http(s)://host[:port]
    [/path]` (the LCD). Nothing connects until a query runs. cosmpy's own calls carry no deadline, and its
    REST client drops URL paths (Gonka's public LCD lives under `/chain-api/`), so gRPC calls go to the
    LedgerClient's stubs with an explicit deadline and REST goes through urllib with a timeout.
    """

    def __init__(self, url: str | None, *, chain_id: str = "gonka-mainnet", timeout_s: float = 10.0) -> None:
        self.url = url or None
        self.chain_id = chain_id
        self.timeout_s = timeout_s
        if self.url is not None and not self.url.startswith(_URL_SCHEMES):
            raise CosmosQueryError(
                f"Cosmos node URL {self.url!r} must start with grpc+http(s):// or rest+http(s)://"
            )
        self._ledger: LedgerClient | None = None

    def balance(self, address: str, denom: str = DENOM) -> int:
        """The account's balance of `denom`, an integer number of base units (0 for an unknown account)."""
        parse_address(address)
        if self._use_rest():
            answer = self._rest_get(f"/cosmos/bank/v1beta1/balances/{address}/by_denom", {"denom": denom})
            coin = _field(answer, "balance", dict, self.url)
            answered_denom, amount = (
                _field(coin, "denom", str, self.url),
                _field(coin, "amount", str, self.url),
            )
        else:
            response = self._grpc(
                lambda ledger: ledger.bank.Balance, QueryBalanceRequest(address=address, denom=denom)
            )
            answered_denom, amount = response.balance.denom, response.balance.amount or "0"
        if answered_denom not in ("", denom):
            raise CosmosQueryError(f"node at {self.url} answered in {answered_denom!r}, asked {denom!r}")
        return _uint(amount, "balance", self.url)

    def account(self, address: str) -> AccountInfo:
        """Account number and sequence of a plain `BaseAccount` (one that has received funds)."""
        parse_address(address)
        if self._use_rest():
            account = _field(
                self._rest_get(f"/cosmos/auth/v1beta1/accounts/{address}"), "account", dict, self.url
            )
            kind = account.get("@type")
            number, sequence = account.get("account_number", "0"), account.get("sequence", "0")
        else:
            packed = self._grpc(
                lambda ledger: ledger.auth.Account, QueryAccountRequest(address=address)
            ).account
            kind, base = "/" + packed.TypeName(), BaseAccount()
            packed.Unpack(base)  # False for other account types: refused just below
            number, sequence = str(base.account_number), str(base.sequence)
        if kind != "/cosmos.auth.v1beta1.BaseAccount":
            # Vesting and module accounts nest the base account; payouts come from plain accounts only.
            raise CosmosQueryError(
                f"{address} is a {kind} on {self.url}; only BaseAccount signers are supported"
            )
        return AccountInfo(_uint(number, "account_number", self.url), _uint(sequence, "sequence", self.url))

    def _use_rest(self) -> bool:
        if self.url is None:
            raise CosmosQueryError("no Cosmos node URL configured; cannot query the Cosmos chain")
        return self.url.startswith("rest+")

    def _grpc(self, method: Callable[[LedgerClient], Callable[..., Any]], request: object) -> Any:
        if self._ledger is None:
            config = NetworkConfig(
                chain_id=self.chain_id,
                url=self.url or "",
                fee_minimum_gas_price=0,
                fee_denomination=DENOM,
                staking_denomination=DENOM,
            )
            self._ledger = LedgerClient(config)  # creates a lazy channel; no I/O yet
        try:
            return method(self._ledger)(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise CosmosQueryError(
                    f"node at {self.url} gave no answer within {self.timeout_s} s"
                ) from exc
            if code == grpc.StatusCode.NOT_FOUND:
                raise CosmosQueryError(
                    f"node at {self.url}: not found (an account exists once funded)"
                ) from exc
            raise CosmosQueryError(f"node at {self.url} failed the query: {code}: {exc}") from exc

    def _rest_get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        base = (self.url or "").removeprefix("rest+").rstrip("/")
        url = base + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                body = response.read(_MAX_REST_ANSWER + 1)
        except urllib.error.HTTPError as exc:
            raise CosmosQueryError(f"node at {base} answered HTTP {exc.code} to {path}") from exc
        except (TimeoutError, urllib.error.URLError) as exc:
            # A connect timeout arrives wrapped in URLError, a read timeout bare.
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                raise CosmosQueryError(f"node at {base} gave no answer within {self.timeout_s} s") from exc
            raise CosmosQueryError(f"node at {base} is unreachable: {exc.reason}") from exc
        if len(body) > _MAX_REST_ANSWER:
            raise CosmosQueryError(f"node at {base} sent an oversized answer to {path}")
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise CosmosQueryError(
                f"node at {base} sent a malformed answer to {path}: {body[:200]!r}"
            ) from exc
        if not isinstance(answer, dict):
            raise CosmosQueryError(f"node at {base} sent a malformed answer to {path}: {body[:200]!r}")
        return answer


def _field(document: dict[str, Any], name: str, kind: type, url: str | None) -> Any:
    value = document.get(name)
    if not isinstance(value, kind):
        raise CosmosQueryError(
            f"node at {url} sent a malformed answer: {name!r} missing or not a {kind.__name__}"
        )
    return value


def _uint(text: object, what: str, url: str | None) -> int:
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or int(text) > UINT64_MAX:
        raise CosmosQueryError(f"node at {url} returned a non-integer or out-of-range {what} {text!r}")
    return int(text)

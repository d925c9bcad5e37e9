"""The Cosmos side, checked on bytes: no Cosmos node can run here.

Addresses are recomputed with hashlib + a bech32 written out below; signed transactions are decoded,
their SignDoc re-encoded by hand (protobuf wire format) and the signature checked with eth-keys, so
neither check goes through the code (cosmpy, the `bech32` package) that produced them.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import grpc
import pytest
from cosmpy.protos.cosmos.auth.v1beta1 import query_pb2 as auth_query
from cosmpy.protos.cosmos.auth.v1beta1 import query_pb2_grpc as auth_query_grpc
from cosmpy.protos.cosmos.auth.v1beta1.auth_pb2 import BaseAccount
from cosmpy.protos.cosmos.bank.v1beta1 import query_pb2, query_pb2_grpc
from cosmpy.protos.cosmos.bank.v1beta1.tx_pb2 import MsgSend
from cosmpy.protos.cosmos.base.v1beta1.coin_pb2 import Coin
from cosmpy.protos.cosmos.crypto.secp256k1.keys_pb2 import PubKey
from cosmpy.protos.cosmos.tx.v1beta1.tx_pb2 import AuthInfo, TxBody, TxRaw
from eth_keys import keys as eth_keys
from google.protobuf.any_pb2 import Any as AnyProto

from chain.cosmos import (
    UINT64_MAX,
    AccountInfo,
    CosmosAccount,
    CosmosAddressError,
    CosmosAmountError,
    CosmosQuery,
    CosmosQueryError,
    CosmosTxError,
    Payout,
    TxParams,
    address_from_public_key,
    check_amount,
    gnk_to_ngonka,
    parse_address,
)
from chain.units import NGONKA_PER_GNK

KEY = bytes.fromhex("4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318")
SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
PARAMS = TxParams(chain_id="gonka-mainnet", account_number=17, sequence=4, gas_limit=200_000, fee_ngonka=500)

# ------------------------------------------------------------------ an independent bech32 (BIP-173)

_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"


def _polymod(values: list[int]) -> int:
    generator = [0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3]
    chk = 1
    for value in values:
        top = chk >> 25
        chk = (chk & 0x1FFFFFF) << 5 ^ value
        for i in range(5):
            chk ^= generator[i] if (top >> i) & 1 else 0
    return chk


def _bech32(hrp: str, data: bytes) -> str:
    bits = "".join(f"{byte:08b}" for byte in data)
    bits += "0" * (-len(bits) % 5)
    words = [int(bits[i : i + 5], 2) for i in range(0, len(bits), 5)]
    expanded = [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]
    polymod = _polymod(expanded + words + [0] * 6) ^ 1
    checksum = [(polymod >> 5 * (5 - i)) & 31 for i in range(6)]
    return hrp + "1" + "".join(_CHARSET[w] for w in words + checksum)


def _independent_address(private_key: bytes, hrp: str = "gonka") -> str:
    compressed = eth_keys.PrivateKey(private_key).public_key.to_compressed_bytes()
    return _bech32(hrp, hashlib.new("ripemd160", hashlib.sha256(compressed).digest()).digest())


# ------------------------------------------------------------------ an independent SignDoc encoder


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _sign_doc(body: bytes, auth_info: bytes, chain_id: str, account_number: int) -> bytes:
    """cosmos.tx.v1beta1.SignDoc: 1 body_bytes, 2 auth_info_bytes, 3 chain_id, 4 account_number (proto3
    omits empty and zero fields)."""
    out = b""
    for field, payload in ((1, body), (2, auth_info), (3, chain_id.encode())):
        if payload:
            out += _varint(field << 3 | 2) + _varint(len(payload)) + payload
    if account_number:
        out += _varint(4 << 3 | 0) + _varint(account_number)
    return out


def _verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    r, s = int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    sig = eth_keys.NonRecoverableSignature(rs=(r, s))
    digest = hashlib.sha256(message).digest()
    return eth_keys.PublicKey.from_compressed_bytes(public_key).verify_msg_hash(digest, sig)


def _recipient(seed: int) -> str:
    return _bech32("gonka", hashlib.sha256(seed.to_bytes(4, "big")).digest()[:20])


# ------------------------------------------------------------------ addresses


def test_address_of_the_generator_point_matches_bip173() -> None:
    # Private key 1 has public key G; BIP-173's example witness program is hash160(G compressed).
    account = CosmosAccount((1).to_bytes(32, "big"))
    assert parse_address(account.address).hex() == "751e76e8199196d454941c45d1b3a323f1433bd6"
    assert account.address == "gonka1w508d6qejxtdg4y5r3zarvary0c5xw7k2gsyg6"


def test_address_matches_independent_derivation_and_differs_from_evm() -> None:
    account = CosmosAccount(KEY)
    assert account.address == _independent_address(KEY)
    assert address_from_public_key(account.public_key) == account.address
    assert CosmosAccount(KEY, prefix="cosmos").address == _independent_address(KEY, "cosmos")
    evm = eth_keys.PrivateKey(KEY).public_key.to_canonical_address()
    assert parse_address(account.address) != evm  # keccak vs ripemd160(sha256): unrelated bytes


def test_uppercase_address_is_the_same_account() -> None:
    address = _recipient(1)
    assert parse_address(address.upper()) == parse_address(address)


def _flip_last(address: str) -> str:
    last = address[-1]
    return address[:-1] + ("q" if last != "q" else "p")


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (_recipient(1).replace("gonka1", "cosmos1", 1), "has prefix 'cosmos'"),
        (_bech32("cosmos", bytes(20)), "has prefix 'cosmos', expected 'gonka'"),
        (_flip_last(_recipient(1)), "fails its bech32 checksum"),
        (_recipient(1)[:-1] + "b", "outside bech32: 'b'"),
        ("gonka1" + _recipient(1)[6:].upper(), "mixes upper and lower case"),
        ("gonkaqqqq", "no bech32 prefix"),
        ("", "non-empty string"),
        (_bech32("gonka", bytes(21)), "decodes to 21 bytes"),
    ],
)
def test_bad_addresses_get_specific_errors(address: str, message: str) -> None:
    with pytest.raises(CosmosAddressError, match=message.replace("(", r"\(")):
        parse_address(address)


def test_32_byte_module_addresses_are_accepted() -> None:
    assert parse_address(_bech32("gonka", bytes(range(32)))) == bytes(range(32))


# ------------------------------------------------------------------ amounts


def test_amount_limits() -> None:
    assert check_amount(UINT64_MAX) == UINT64_MAX
    assert check_amount(0, allow_zero=True) == 0
    with pytest.raises(CosmosAmountError, match="must be > 0"):
        check_amount(0)
    with pytest.raises(CosmosAmountError, match="must be > 0"):
        check_amount(-5)
    with pytest.raises(CosmosAmountError, match="overflows uint64"):
        check_amount(UINT64_MAX + 1)
    for not_int in (True, 1.0, "5", None):
        with pytest.raises(CosmosAmountError, match="must be an integer"):
            check_amount(not_int)  # type: ignore[arg-type]


def test_gnk_to_ngonka() -> None:
    assert gnk_to_ngonka("1.5") == 3 * NGONKA_PER_GNK // 2
    assert gnk_to_ngonka("0.000000001") == 1
    assert gnk_to_ngonka("18446744073.709551615") == UINT64_MAX
    for bad, message in [
        ("0.0000000001", "more than 9 decimals"),
        ("1.0000000000000000000000000001", "more than 9 decimals"),  # 29 digits: no silent rounding
        ("18446744073.709551616", "overflows uint64"),
        ("-1", "must be > 0"),
        ("nan", "not finite"),
        ("one", "not a decimal"),
    ]:
        with pytest.raises(CosmosAmountError, match=message):
            gnk_to_ngonka(bad)


# ------------------------------------------------------------------ signed payouts


def test_signed_payout_decodes_and_verifies_independently() -> None:
    account = CosmosAccount(KEY)
    payouts = [Payout(_recipient(1), 1_500_000_000), Payout(_recipient(2), UINT64_MAX)]
    signed = account.sign_payouts(payouts, PARAMS)

    assert signed.tx_hash == hashlib.sha256(signed.tx_raw).hexdigest().upper()
    assert signed.sender == account.address
    assert signed.total_ngonka == 1_500_000_000 + UINT64_MAX
    raw = TxRaw.FromString(signed.tx_raw)
    body, auth_info = TxBody.FromString(raw.body_bytes), AuthInfo.FromString(raw.auth_info_bytes)

    assert [m.type_url for m in body.messages] == ["/cosmos.bank.v1beta1.MsgSend"] * 2
    sends = [MsgSend.FromString(m.value) for m in body.messages]
    assert [(s.from_address, s.to_address) for s in sends] == [
        (account.address, p.recipient) for p in payouts
    ]
    assert [[(c.denom, c.amount) for c in s.amount] for s in sends] == [
        [("ngonka", "1500000000")],
        [("ngonka", "18446744073709551615")],
    ]
    assert body.memo == "" and body.timeout_height == 0

    (signer,) = auth_info.signer_infos
    assert signer.public_key.type_url == "/cosmos.crypto.secp256k1.PubKey"
    public_key = PubKey.FromString(signer.public_key.value).key
    assert public_key == eth_keys.PrivateKey(KEY).public_key.to_compressed_bytes()
    assert signer.mode_info.single.mode == 1  # SIGN_MODE_DIRECT in cosmos.tx.signing.v1beta1
    assert signer.sequence == 4
    assert [(c.denom, c.amount) for c in auth_info.fee.amount] == [("ngonka", "500")]
    assert auth_info.fee.gas_limit == 200_000

    (signature,) = raw.signatures
    assert len(signature) == 64
    assert int.from_bytes(signature[32:], "big") <= SECP256K1_N // 2  # low-S, or the chain rejects it
    doc = _sign_doc(raw.body_bytes, raw.auth_info_bytes, "gonka-mainnet", 17)
    assert _verify(public_key, signature, doc)
    # The signature commits to the chain and the account: the same bytes elsewhere do not verify.
    assert not _verify(
        public_key, signature, _sign_doc(raw.body_bytes, raw.auth_info_bytes, "gonka-test", 17)
    )
    assert not _verify(
        public_key, signature, _sign_doc(raw.body_bytes, raw.auth_info_bytes, "gonka-mainnet", 18)
    )


def test_memo_timeout_and_zero_fee_are_encoded() -> None:
    params = TxParams("gonka-1", 0, 0, gas_limit=1, fee_ngonka=0, memo="epoch 3 round 7", timeout_height=99)
    signed = CosmosAccount(KEY).sign_payouts([Payout(_recipient(3), 1)], params)
    raw = TxRaw.FromString(signed.tx_raw)
    body, auth_info = TxBody.FromString(raw.body_bytes), AuthInfo.FromString(raw.auth_info_bytes)
    assert (body.memo, body.timeout_height) == ("epoch 3 round 7", 99)
    assert list(auth_info.fee.amount) == []  # the SDK rejects a zero-amount coin; zero fee is no coin
    public_key = CosmosAccount(KEY).public_key
    assert _verify(
        public_key, raw.signatures[0], _sign_doc(raw.body_bytes, raw.auth_info_bytes, "gonka-1", 0)
    )


def test_signing_is_deterministic_and_commits_to_sequence() -> None:
    account, payouts = CosmosAccount(KEY), [Payout(_recipient(1), 10)]
    first = account.sign_payouts(payouts, PARAMS)
    assert account.sign_payouts(payouts, PARAMS).tx_raw == first.tx_raw
    later = TxParams(PARAMS.chain_id, PARAMS.account_number, 5, PARAMS.gas_limit, PARAMS.fee_ngonka)
    assert account.sign_payouts(payouts, later).tx_hash != first.tx_hash


@pytest.mark.parametrize(
    ("payouts", "error", "message"),
    [
        ([], CosmosTxError, "at least one MsgSend"),
        ([Payout(_recipient(1), 0)], CosmosAmountError, "must be > 0"),
        ([Payout(_recipient(1), -3)], CosmosAmountError, "must be > 0"),
        ([Payout(_recipient(1), UINT64_MAX + 1)], CosmosAmountError, "overflows uint64"),
        ([Payout(_bech32("cosmos", bytes(20)), 5)], CosmosAddressError, "expected 'gonka'"),
        ([Payout(_flip_last(_recipient(1)), 5)], CosmosAddressError, "checksum"),
        ([Payout(_recipient(1), 5), Payout(_recipient(1).upper(), 6)], CosmosTxError, "appears twice"),
    ],
)
def test_bad_payouts_are_refused(payouts: list[Payout], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        CosmosAccount(KEY).sign_payouts(payouts, PARAMS)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"chain_id": ""}, CosmosTxError, "chain_id"),
        ({"chain_id": "x" * 51}, CosmosTxError, "chain_id"),
        ({"account_number": -1}, CosmosTxError, "account_number"),
        ({"sequence": UINT64_MAX + 1}, CosmosTxError, "sequence"),
        ({"gas_limit": 0}, CosmosTxError, "gas_limit"),
        ({"fee_ngonka": -1}, CosmosAmountError, "fee must be ≥ 0"),
        ({"fee_ngonka": UINT64_MAX + 1}, CosmosAmountError, "overflows"),
        ({"memo": "m" * 257}, CosmosTxError, "memo"),
    ],
)
def test_bad_tx_params_are_refused(fields: dict[str, object], error: type[Exception], message: str) -> None:
    base: dict[str, object] = {
        "chain_id": "gonka-mainnet",
        "account_number": 1,
        "sequence": 0,
        "gas_limit": 100_000,
        "fee_ngonka": 0,
    }
    with pytest.raises(error, match=message):
        TxParams(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [KEY[:31], bytes(32), SECP256K1_N.to_bytes(32, "big")])
def test_bad_private_keys_are_refused(key: bytes) -> None:
    with pytest.raises(CosmosTxError, match="private key"):
        CosmosAccount(key)


def test_repr_hides_the_private_key() -> None:
    account = CosmosAccount(KEY)
    assert KEY.hex() not in repr(account) and account.address in repr(account)


# ------------------------------------------------------------------ balance queries


class _Bank(query_pb2_grpc.QueryServicer):
    def __init__(self) -> None:
        self.requests: list[query_pb2.QueryBalanceRequest] = []

    def Balance(self, request, context):  # the generated servicer name
        self.requests.append(request)
        return query_pb2.QueryBalanceResponse(balance=Coin(denom=request.denom, amount="123456789"))


class _Auth(auth_query_grpc.QueryServicer):
    """Knows one funded account; any other address is NOT_FOUND, as on a real node."""

    def __init__(self, address: str) -> None:
        self.address = address

    def Account(self, request, context):  # the generated servicer name
        if request.address != self.address:
            context.abort(grpc.StatusCode.NOT_FOUND, f"account {request.address} not found")
        packed = AnyProto()
        packed.Pack(BaseAccount(address=self.address, account_number=31, sequence=9), type_url_prefix="/")
        return auth_query.QueryAccountResponse(account=packed)


@pytest.fixture
def bank_server() -> Iterator[tuple[int, _Bank]]:
    bank = _Bank()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    query_pb2_grpc.add_QueryServicer_to_server(bank, server)
    auth_query_grpc.add_QueryServicer_to_server(_Auth(CosmosAccount(KEY).address), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, bank
    server.stop(grace=None)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port bound but not listening: connections are refused, and nobody else can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_grpc_balance_against_a_real_grpc_server(bank_server: tuple[int, _Bank]) -> None:
    port, bank = bank_server
    address = CosmosAccount(KEY).address
    assert CosmosQuery(f"grpc+http://127.0.0.1:{port}").balance(address) == 123456789
    assert [(r.address, r.denom) for r in bank.requests] == [(address, "ngonka")]


def test_grpc_account_against_a_real_grpc_server(bank_server: tuple[int, _Bank]) -> None:
    query = CosmosQuery(f"grpc+http://127.0.0.1:{bank_server[0]}")
    assert query.account(CosmosAccount(KEY).address) == AccountInfo(account_number=31, sequence=9)
    with pytest.raises(CosmosQueryError, match="not found"):
        query.account(_recipient(1))


def test_no_url_means_no_query() -> None:
    with pytest.raises(CosmosQueryError, match="no Cosmos node URL configured"):
        CosmosQuery(None).balance(_recipient(1))
    with pytest.raises(CosmosQueryError, match="no Cosmos node URL configured"):
        CosmosQuery("").account(_recipient(1))


def test_unknown_url_scheme_is_refused_up_front() -> None:
    with pytest.raises(CosmosQueryError, match="must start with grpc"):
        CosmosQuery("http://127.0.0.1:1317")


def test_query_checks_the_address_before_any_io() -> None:
    with pytest.raises(CosmosAddressError):
        CosmosQuery(None).balance(_bech32("cosmos", bytes(20)))


@pytest.mark.parametrize("scheme", ["grpc+http", "rest+http"])
def test_refused_connection_fails_fast(scheme: str, refused_port: int) -> None:
    start = time.monotonic()
    with pytest.raises(CosmosQueryError, match=f"127.0.0.1:{refused_port}"):
        CosmosQuery(f"{scheme}://127.0.0.1:{refused_port}", timeout_s=5).balance(_recipient(1))
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("scheme", ["grpc+http", "rest+http"])
def test_silent_node_times_out(scheme: str, silent_port: int) -> None:
    start = time.monotonic()
    with pytest.raises(CosmosQueryError, match=r"no answer within 0.5 s"):
        CosmosQuery(f"{scheme}://127.0.0.1:{silent_port}", timeout_s=0.5).balance(_recipient(1))
    assert time.monotonic() - start < 3


class _Lcd(BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, tuple[int, bytes]]] = {}
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        status, body = self.answers.get(self.path.split("?")[0], (404, b"{}"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def lcd() -> Iterator[tuple[str, type[_Lcd]]]:
    handler = type("Lcd", (_Lcd,), {"answers": {}, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"rest+http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_rest_balance_keeps_the_url_path(lcd: tuple[str, type[_Lcd]]) -> None:
    url, handler = lcd
    address = _recipient(7)
    path = f"/chain-api/cosmos/bank/v1beta1/balances/{address}/by_denom"
    handler.answers[path] = (200, json.dumps({"balance": {"denom": "ngonka", "amount": "42"}}).encode())
    assert CosmosQuery(f"{url}/chain-api/").balance(address) == 42
    assert handler.seen == [f"{path}?denom=ngonka"]


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (500, b"{}", "HTTP 500"),
        (200, b"not json", "malformed answer"),
        (200, b"[1, 2]", "malformed answer"),
        (200, b'{"balance": {"denom": "ngonka"}}', "'amount' missing"),
        (200, b'{"balance": {"denom": "uatom", "amount": "1"}}', "answered in 'uatom'"),
        (200, b'{"balance": {"denom": "ngonka", "amount": "-1"}}', "non-integer or out-of-range balance"),
        (200, b'{"balance": {"denom": "ngonka", "amount": "18446744073709551616"}}', "out-of-range"),
        (
            200,
            b'{"balance": {"denom": "ngonka", "amount": "1"}, "pad": "' + b"x" * 70_000 + b'"}',
            "oversized",
        ),
    ],
)
def test_rest_bad_answers(lcd: tuple[str, type[_Lcd]], status: int, body: bytes, message: str) -> None:
    url, handler = lcd
    address = _recipient(8)
    handler.answers[f"/cosmos/bank/v1beta1/balances/{address}/by_denom"] = (status, body)
    with pytest.raises(CosmosQueryError, match=message):
        CosmosQuery(url).balance(address)


def test_rest_account(lcd: tuple[str, type[_Lcd]]) -> None:
    url, handler = lcd
    plain, vesting = _recipient(9), _recipient(10)
    handler.answers[f"/cosmos/auth/v1beta1/accounts/{plain}"] = (
        200,
        json.dumps(
            {"account": {"@type": "/cosmos.auth.v1beta1.BaseAccount", "account_number": "7", "sequence": "2"}}
        ).encode(),
    )
    handler.answers[f"/cosmos/auth/v1beta1/accounts/{vesting}"] = (
        200,
        json.dumps({"account": {"@type": "/cosmos.vesting.v1beta1.ContinuousVestingAccount"}}).encode(),
    )
    assert CosmosQuery(url).account(plain) == AccountInfo(account_number=7, sequence=2)
    with pytest.raises(CosmosQueryError, match="only BaseAccount signers"):
        CosmosQuery(url).account(vesting)
    with pytest.raises(CosmosQueryError, match="HTTP 404"):
        CosmosQuery(url).account(_recipient(11))

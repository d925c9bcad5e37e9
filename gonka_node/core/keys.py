"""A host's two keys and where they live on disk.

- The **node key** (ed25519, pynacl) signs submissions; its 32-byte public key is registered on chain at
  sign-in. Cheap to verify for many large submissions.
- The **EVM account** (secp256k1, eth-account) sends chain transactions and receives rewards. The same
  private key also backs a Cosmos account on Gonka's chain (`gonka1…`, see `chain.cosmos`).

A key directory (default `~/.gonka/keys`, mode 0700) holds `node_key.json` and `evm_key.json` (mode
0600, created so from the first byte). Encrypted, the EVM key is a standard keystore v3 file (scrypt +
AES-128-CTR; geth and MetaMask import it) and the node key's 32-byte seed is sealed with libsodium's
SecretBox (XSalsa20-Poly1305) under a key derived by argon2id from the passphrase. Plaintext files
(devnets only) hold hex keys and say `"encryption": null`. docs/PROTOCOL.md ("Keys") gives the layout.

Private keys never appear in a repr, a log line or an exception message.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nacl.pwhash.argon2id as argon2id
from eth_account import Account
from eth_account.signers.local import LocalAccount
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.secret import SecretBox
from nacl.signing import SigningKey, VerifyKey
from nacl.utils import random as random_bytes

from chain.cosmos import SECP256K1_ORDER, CosmosAccount
from training.durable import durable_replace, write_new_file

DEFAULT_KEY_DIR = Path("~/.gonka/keys")
NODE_KEY_FILE = "node_key.json"
EVM_KEY_FILE = "evm_key.json"
NODE_KEY_KIND = "gonka-node-key"
EVM_KEY_KIND = "gonka-evm-key"
FORMAT_VERSION = 1
MAX_KEY_FILE_BYTES = 64 * 1024


class KeyStoreError(Exception):
    """A key could not be created or loaded; the message names the file and what to do."""


class KeysExistError(KeyStoreError):
    """Refusing to overwrite existing keys (pass force=True / --force to replace them)."""


class KeysNotFoundError(KeyStoreError):
    """A key file is missing."""


class InsecurePermissionsError(KeyStoreError):
    """A key file or directory is accessible to group or others."""


class PassphraseRequiredError(KeyStoreError):
    """The key file is encrypted and no passphrase was given."""


class WrongPassphraseError(KeyStoreError):
    """The passphrase does not decrypt the key file."""


class KeyFileFormatError(KeyStoreError):
    """A key file is not one of the formats this module writes, or its parameters are out of bounds."""


@dataclass(frozen=True)
class KdfCost:
    """Work factors of the passphrase KDFs. STANDARD: 1.7-3.6 s to unlock both keys here; INTERACTIVE ~0.2 s."""

    scrypt_n: int
    argon2_opslimit: int
    argon2_memlimit: int


STANDARD_KDF = KdfCost(2**18, argon2id.OPSLIMIT_MODERATE, argon2id.MEMLIMIT_MODERATE)
INTERACTIVE_KDF = KdfCost(2**14, argon2id.OPSLIMIT_INTERACTIVE, argon2id.MEMLIMIT_INTERACTIVE)
# Reading: a key file chooses its own KDF cost; cap it so a hostile file cannot ask for 100 GB of RAM.
_MAX_SCRYPT_MEMORY = 1 << 30  # 128 * n * r bytes
_MAX_PBKDF2_ROUNDS = 10_000_000


# ---------------------------------------------------------------------------------------------- node key


class NodeSigningKey:
    """An ed25519 key that signs submissions. `public_key` is what the chain registers."""

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes) or len(seed) != 32:
            raise KeyFileFormatError("an ed25519 seed is exactly 32 bytes")
        self._key = SigningKey(seed)
        self.public_key: bytes = bytes(self._key.verify_key)

    @classmethod
    def generate(cls) -> NodeSigningKey:
        return cls(random_bytes(32))

    @property
    def signing_key(self) -> SigningKey:
        """The pynacl key, for code that takes one (e.g. `gonka_node.core.envelope`)."""
        return self._key

    def sign(self, message: bytes) -> bytes:
        """The 64-byte detached ed25519 signature over `message`."""
        return self._key.sign(message).signature

    def export_seed(self) -> bytes:
        """The 32-byte secret seed. Only for writing it into a key file."""
        return bytes(self._key)

    def __repr__(self) -> str:
        return f"NodeSigningKey(public_key={self.public_key.hex()})"


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when `signature` is `public_key`'s ed25519 signature over `message`; False otherwise."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        VerifyKey(bytes(public_key)).verify(message, bytes(signature))
    except (BadSignatureError, ValueError):  # ValueError: not a point on the curve
        return False
    return True


# ---------------------------------------------------------------------------------------------- both keys


@dataclass(frozen=True, repr=False)
class NodeKeys:
    node_key: NodeSigningKey
    evm_account: LocalAccount

    @property
    def node_public_key(self) -> bytes:
        return self.node_key.public_key

    @property
    def evm_address(self) -> str:
        return str(self.evm_account.address)

    def cosmos_account(self) -> CosmosAccount:
        """The Cosmos account backed by the same secp256k1 key as the EVM account."""
        return CosmosAccount(bytes(self.evm_account.key))

    @property
    def cosmos_address(self) -> str:
        return self.cosmos_account().address

    def __repr__(self) -> str:
        return f"NodeKeys(node_public_key={self.node_public_key.hex()}, evm_address={self.evm_address})"


def parse_private_key_hex(text: str, what: str) -> bytes:
    """32 bytes from 64 hex digits (optional 0x, surrounding whitespace ignored); never echoes the text."""
    cleaned = text.strip().removeprefix("0x").removeprefix("0X")
    if len(cleaned) != 64:
        raise KeyFileFormatError(f"{what} must be 64 hex digits (32 bytes), got {len(cleaned)} characters")
    try:
        return bytes.fromhex(cleaned)
    except ValueError:
        raise KeyFileFormatError(f"{what} contains characters that are not hex digits") from None


def _check_evm_private_key(key: bytes) -> bytes:
    if len(key) != 32 or not 0 < int.from_bytes(key, "big") < SECP256K1_ORDER:
        raise KeyFileFormatError("EVM private key is not a valid secp256k1 key (zero or ≥ the group order)")
    return key


# ---------------------------------------------------------------------------------------------- create


def init_keys(
    key_dir: Path,
    passphrase: str | None,
    *,
    insecure_plaintext: bool = False,
    force: bool = False,
    kdf: KdfCost = STANDARD_KDF,
    node_seed: bytes | None = None,
    evm_private_key: bytes | None = None,
) -> NodeKeys:
    """Create both keys (fresh unless given) in `key_dir`. Refuses to overwrite either without `force`."""
    key_dir = Path(key_dir).expanduser()
    _check_protection(passphrase, insecure_plaintext)
    if not force:
        _refuse_existing(key_dir, (NODE_KEY_FILE, EVM_KEY_FILE))
    keys = NodeKeys(
        NodeSigningKey(node_seed) if node_seed is not None else NodeSigningKey.generate(),
        Account.from_key(_check_evm_private_key(evm_private_key))
        if evm_private_key is not None
        else Account.create(),
    )
    _write_key_files(key_dir, keys, (NODE_KEY_FILE, EVM_KEY_FILE), passphrase, kdf)
    return keys


def import_keys(
    key_dir: Path,
    passphrase: str | None,
    *,
    node_seed: bytes | None = None,
    evm_private_key: bytes | None = None,
    insecure_plaintext: bool = False,
    force: bool = False,
    kdf: KdfCost = STANDARD_KDF,
) -> tuple[NodeKeys, list[str]]:
    """Write the given key(s); a key not given is kept if its file exists, else generated.

    Returns the keys and the names of the files written. Refuses to replace a given key's existing file
    without `force`; a kept file must open with the same passphrase.
    """
    if node_seed is None and evm_private_key is None:
        raise KeyStoreError("nothing to import: give a node key, an EVM key or both")
    key_dir = Path(key_dir).expanduser()
    _check_protection(passphrase, insecure_plaintext)
    given = [
        name for name, key in ((NODE_KEY_FILE, node_seed), (EVM_KEY_FILE, evm_private_key)) if key is not None
    ]
    if not force:
        _refuse_existing(key_dir, given)
    node_path, evm_path = key_dir / NODE_KEY_FILE, key_dir / EVM_KEY_FILE
    if node_seed is not None:
        node_key = NodeSigningKey(node_seed)
    elif node_path.exists():
        node_key = load_node_key(node_path, passphrase)
    else:
        node_key, given = NodeSigningKey.generate(), [*given, NODE_KEY_FILE]
    if evm_private_key is not None:
        account = Account.from_key(_check_evm_private_key(evm_private_key))
    elif evm_path.exists():
        account = load_evm_account(evm_path, passphrase)
    else:
        account, given = Account.create(), [*given, EVM_KEY_FILE]
    keys = NodeKeys(node_key, account)
    _write_key_files(key_dir, keys, given, passphrase, kdf)
    return keys, given


def _check_protection(passphrase: str | None, insecure_plaintext: bool) -> None:
    if insecure_plaintext and passphrase is not None:
        raise KeyStoreError("give either a passphrase or insecure_plaintext, not both")
    if not insecure_plaintext and not passphrase:
        raise PassphraseRequiredError(
            "an empty passphrase would leave the keys unprotected; give one, or choose plaintext keys "
            "explicitly (--insecure-plaintext, devnets only)"
        )


def _refuse_existing(key_dir: Path, names: list[str] | tuple[str, ...]) -> None:
    existing = [str(key_dir / n) for n in names if (key_dir / n).exists()]
    if existing:
        raise KeysExistError(f"{', '.join(existing)} already exist(s); pass --force to replace")


def _write_key_files(
    key_dir: Path, keys: NodeKeys, names: Sequence[str], passphrase: str | None, kdf: KdfCost
) -> None:
    _make_private_dir(key_dir)
    documents = {
        NODE_KEY_FILE: lambda: _node_document(keys.node_key, passphrase, kdf),
        EVM_KEY_FILE: lambda: _evm_document(keys.evm_account, passphrase, kdf),
    }
    # Encrypt everything before touching the directory, so a failure leaves no half-written pair.
    payloads = {name: json.dumps(documents[name](), indent=2).encode() + b"\n" for name in names}
    for name, payload in payloads.items():
        _write_private_file(key_dir / name, payload)


def _node_document(key: NodeSigningKey, passphrase: str | None, kdf: KdfCost) -> dict[str, Any]:
    document: dict[str, Any] = {
        "kind": NODE_KEY_KIND,
        "version": FORMAT_VERSION,
        "public_key": key.public_key.hex(),
    }
    if passphrase is None:
        return {**document, "encryption": None, "seed": key.export_seed().hex()}
    salt = random_bytes(argon2id.SALTBYTES)
    box_key = argon2id.kdf(
        SecretBox.KEY_SIZE, passphrase.encode(), salt, kdf.argon2_opslimit, kdf.argon2_memlimit
    )
    sealed = SecretBox(box_key).encrypt(key.export_seed())  # 24-byte random nonce || ciphertext || MAC
    encryption = {
        "kdf": "argon2id",
        "salt": salt.hex(),
        "opslimit": kdf.argon2_opslimit,
        "memlimit": kdf.argon2_memlimit,
        "cipher": "xsalsa20-poly1305",
        "sealed": bytes(sealed).hex(),
    }
    return {**document, "encryption": encryption}


def _evm_document(account: LocalAccount, passphrase: str | None, kdf: KdfCost) -> dict[str, Any]:
    if passphrase is None:
        return {
            "kind": EVM_KEY_KIND,
            "version": FORMAT_VERSION,
            "address": account.address,
            "encryption": None,
            "private_key": bytes(account.key).hex(),
        }
    return dict(Account.encrypt(account.key, passphrase, kdf="scrypt", iterations=kdf.scrypt_n))


# ---------------------------------------------------------------------------------------------- load


def load_keys(key_dir: Path, passphrase: str | None = None) -> NodeKeys:
    """Both keys of `key_dir`; `passphrase` is needed only if the files are encrypted."""
    key_dir = Path(key_dir).expanduser()
    _check_dir(key_dir)
    return NodeKeys(
        load_node_key(key_dir / NODE_KEY_FILE, passphrase),
        load_evm_account(key_dir / EVM_KEY_FILE, passphrase),
    )


def keys_encrypted(key_dir: Path) -> bool:
    """Whether any key file of `key_dir` needs a passphrase (so a CLI knows to prompt)."""
    key_dir = Path(key_dir).expanduser()
    _check_dir(key_dir)
    node = _read_private_json(key_dir / NODE_KEY_FILE)
    evm = _read_private_json(key_dir / EVM_KEY_FILE)
    return node.get("encryption") is not None or "crypto" in evm


def load_node_key(path: Path, passphrase: str | None = None) -> NodeSigningKey:
    document = _read_private_json(path)
    if document.get("kind") != NODE_KEY_KIND or document.get("version") != FORMAT_VERSION:
        raise KeyFileFormatError(f"{path}: not a {NODE_KEY_KIND} version {FORMAT_VERSION} file")
    encryption = document.get("encryption")
    if encryption is None:
        seed = _hex_field(path, document, "seed", 32)
    elif passphrase is None:
        raise PassphraseRequiredError(f"{path} is encrypted; a passphrase is needed to open it")
    else:
        seed = _open_sealed_seed(path, encryption, passphrase)
    key = NodeSigningKey(seed)
    if key.public_key != _hex_field(path, document, "public_key", 32):
        raise KeyFileFormatError(f"{path}: the seed does not match the recorded public_key (file altered?)")
    return key


def _open_sealed_seed(path: Path, encryption: Any, passphrase: str) -> bytes:
    try:
        salt = bytes.fromhex(encryption["salt"])
        opslimit, memlimit = int(encryption["opslimit"]), int(encryption["memlimit"])
        sealed = bytes.fromhex(encryption["sealed"])
        scheme = (encryption["kdf"], encryption["cipher"])
    except (KeyError, TypeError, ValueError) as exc:
        raise KeyFileFormatError(f"{path}: malformed 'encryption' section ({exc})") from None
    if scheme != ("argon2id", "xsalsa20-poly1305") or len(salt) != argon2id.SALTBYTES:
        raise KeyFileFormatError(f"{path}: unsupported encryption {scheme} or salt length")
    if not (argon2id.OPSLIMIT_MIN <= opslimit <= argon2id.OPSLIMIT_SENSITIVE) or not (
        argon2id.MEMLIMIT_MIN <= memlimit <= argon2id.MEMLIMIT_SENSITIVE
    ):
        raise KeyFileFormatError(
            f"{path}: argon2id cost out of bounds (opslimit {opslimit}, memlimit {memlimit})"
        )
    box_key = argon2id.kdf(SecretBox.KEY_SIZE, passphrase.encode(), salt, opslimit, memlimit)
    try:
        return SecretBox(box_key).decrypt(sealed)
    except CryptoError:
        raise WrongPassphraseError(f"{path}: wrong passphrase (or the file was altered)") from None


def load_evm_account(path: Path, passphrase: str | None = None) -> LocalAccount:
    document = _read_private_json(path)
    if document.get("kind") == EVM_KEY_KIND and document.get("encryption", 0) is None:
        account = Account.from_key(_check_evm_private_key(_hex_field(path, document, "private_key", 32)))
        if document.get("address", "").lower() != account.address.lower():
            raise KeyFileFormatError(f"{path}: the key does not match the recorded address (file altered?)")
        return account
    if document.get("version") != 3 or not isinstance(document.get("crypto"), Mapping):
        raise KeyFileFormatError(f"{path}: neither a keystore v3 file nor a plaintext {EVM_KEY_KIND} file")
    if passphrase is None:
        raise PassphraseRequiredError(f"{path} is encrypted; a passphrase is needed to open it")
    _check_keystore_cost(path, document["crypto"])
    try:
        key = Account.decrypt(document, passphrase)
    except ValueError as exc:
        if "MAC mismatch" in str(exc):
            raise WrongPassphraseError(f"{path}: wrong passphrase (or the file was altered)") from None
        raise KeyFileFormatError(f"{path}: unreadable keystore ({exc})") from None
    return Account.from_key(key)


def _check_keystore_cost(path: Path, crypto: Mapping[str, Any]) -> None:
    params: Any = crypto.get("kdfparams")  # anything at all: a wrong type is a malformed file below
    try:
        if crypto.get("kdf") == "scrypt":
            n, r, p = int(params["n"]), int(params["r"]), int(params["p"])
            ok = 128 * n * r <= _MAX_SCRYPT_MEMORY and 1 <= p <= 16
        elif crypto.get("kdf") == "pbkdf2":
            ok = int(params["c"]) <= _MAX_PBKDF2_ROUNDS
        else:
            raise KeyFileFormatError(f"{path}: unsupported keystore kdf {crypto.get('kdf')!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise KeyFileFormatError(f"{path}: malformed keystore kdfparams ({exc})") from None
    if not ok:
        raise KeyFileFormatError(f"{path}: keystore KDF cost out of bounds ({dict(params)})")


# ---------------------------------------------------------------------------------------------- files


def _make_private_dir(key_dir: Path) -> None:
    key_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        key_dir.mkdir(mode=0o700)
    except FileExistsError:
        pass  # an existing directory must already be private: _check_dir below refuses it otherwise
    else:
        os.chmod(key_dir, 0o700)  # exactly 0700 whatever the umask; it is new and empty
    _check_dir(key_dir)


def _check_dir(key_dir: Path) -> None:
    try:
        st = key_dir.lstat()
    except FileNotFoundError:
        raise KeysNotFoundError(f"{key_dir}: no such key directory (run `gonka-node keys init`)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise KeyStoreError(f"{key_dir} is not a directory")
    if st.st_mode & 0o077:
        raise InsecurePermissionsError(
            f"{key_dir} is accessible to group/others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run `chmod 700 {key_dir}`"
        )


def _write_private_file(path: Path, payload: bytes) -> None:
    """Write via a 0600 temp file + rename: never a moment with wider permissions or half a key."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_new_file(tmp, payload, 0o600)
    durable_replace(tmp, path)


def _read_private_json(path: Path) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise KeysNotFoundError(f"{path}: no such key file (run `gonka-node keys init`)") from None
    except OSError as exc:
        raise KeyStoreError(f"{path}: cannot open key file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file actually opened, not whatever the path names a moment later
        if not stat.S_ISREG(st.st_mode):
            raise KeyStoreError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise InsecurePermissionsError(
                f"{path} is readable or writable by group/others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod 600 {path}` if nobody else could have read it, else make new keys"
            )
        raw = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise KeyFileFormatError(f"{path}: larger than {MAX_KEY_FILE_BYTES} bytes, not a key file")
    try:
        document = json.loads(raw)
    except ValueError:
        raise KeyFileFormatError(f"{path}: not JSON") from None  # no excerpt: it may hold a key
    if not isinstance(document, dict):
        raise KeyFileFormatError(f"{path}: expected a JSON object")
    return document


def _hex_field(path: Path, document: Mapping[str, Any], name: str, size: int) -> bytes:
    value = document.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise KeyFileFormatError(f"{path}: field {name!r} must be {2 * size} hex digits")
    return raw

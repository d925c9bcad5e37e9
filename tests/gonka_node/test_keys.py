"""Node keys on disk: permissions, encryption, refusals, and the `gonka-node keys` verbs."""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from eth_account import Account
from eth_keys import keys as eth_keys
from nacl.signing import SigningKey

from chain.cosmos import address_from_public_key
from gonka_node.cli import main
from gonka_node.core import keys
from gonka_node.core.keys import (
    INTERACTIVE_KDF,
    InsecurePermissionsError,
    KeyFileFormatError,
    KeysExistError,
    KeyStoreError,
    PassphraseRequiredError,
    WrongPassphraseError,
    import_keys,
    init_keys,
    load_evm_account,
    load_keys,
    load_node_key,
    verify,
)

PASS = "correct horse battery staple"
SEED = bytes(range(32))
EVM_KEY = bytes.fromhex("4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _init(key_dir: Path, passphrase: str | None = PASS, **kwargs: object) -> keys.NodeKeys:
    return init_keys(
        key_dir,
        passphrase,
        insecure_plaintext=passphrase is None,
        kdf=INTERACTIVE_KDF,
        node_seed=SEED,
        evm_private_key=EVM_KEY,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
def no_umask() -> Iterator[None]:
    """umask 0: any mode the files get comes from the code, not from a protective umask."""
    old = os.umask(0)
    yield
    os.umask(old)


# ---------------------------------------------------------------------------------------------- API


@pytest.mark.parametrize("passphrase", [PASS, None], ids=["encrypted", "plaintext"])
def test_init_makes_0700_dir_and_0600_files(tmp_path: Path, no_umask: None, passphrase: str | None) -> None:
    key_dir = tmp_path / "home" / "keys"
    _init(key_dir, passphrase)
    assert _mode(key_dir) == 0o700
    assert sorted(p.name for p in key_dir.iterdir()) == ["evm_key.json", "node_key.json"]  # no temp left
    for name in ("evm_key.json", "node_key.json"):
        assert _mode(key_dir / name) == 0o600


def test_encrypted_round_trip_and_no_secret_on_disk(tmp_path: Path) -> None:
    created = _init(tmp_path / "k")
    loaded = load_keys(tmp_path / "k", PASS)
    assert loaded.node_public_key == created.node_public_key == SigningKey(SEED).verify_key.encode()
    assert loaded.evm_address == Account.from_key(EVM_KEY).address
    for name in ("node_key.json", "evm_key.json"):
        text = (tmp_path / "k" / name).read_text().lower()
        assert SEED.hex() not in text and EVM_KEY.hex() not in text
    node_file = json.loads((tmp_path / "k" / "node_key.json").read_text())
    assert node_file["encryption"]["kdf"] == "argon2id"
    assert node_file["encryption"]["memlimit"] == INTERACTIVE_KDF.argon2_memlimit
    evm_file = json.loads((tmp_path / "k" / "evm_key.json").read_text())
    assert evm_file["version"] == 3 and evm_file["crypto"]["kdfparams"]["n"] == INTERACTIVE_KDF.scrypt_n


def test_plaintext_round_trip(tmp_path: Path) -> None:
    _init(tmp_path / "k", None)
    loaded = load_keys(tmp_path / "k")
    assert loaded.node_key.export_seed() == SEED
    assert bytes(loaded.evm_account.key) == EVM_KEY


def test_wrong_passphrase_names_the_file(tmp_path: Path) -> None:
    _init(tmp_path / "k")
    with pytest.raises(WrongPassphraseError, match=r"node_key\.json: wrong passphrase"):
        load_keys(tmp_path / "k", "not it")
    with pytest.raises(WrongPassphraseError, match=r"evm_key\.json: wrong passphrase"):
        load_evm_account(tmp_path / "k" / "evm_key.json", "not it")


def test_encrypted_keys_need_a_passphrase(tmp_path: Path) -> None:
    _init(tmp_path / "k")
    with pytest.raises(PassphraseRequiredError, match=r"node_key\.json is encrypted"):
        load_keys(tmp_path / "k")
    assert keys.keys_encrypted(tmp_path / "k")


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    _init(tmp_path / "k")
    before = {p.name: p.read_bytes() for p in (tmp_path / "k").iterdir()}
    with pytest.raises(KeysExistError, match="--force"):
        init_keys(tmp_path / "k", PASS, kdf=INTERACTIVE_KDF)
    assert {p.name: p.read_bytes() for p in (tmp_path / "k").iterdir()} == before
    replaced = init_keys(tmp_path / "k", PASS, kdf=INTERACTIVE_KDF, force=True)
    assert replaced.node_key.export_seed() != SEED
    assert load_keys(tmp_path / "k", PASS).evm_address == replaced.evm_address


@pytest.mark.parametrize("name", ["node_key.json", "evm_key.json"])
def test_group_readable_key_file_is_refused(tmp_path: Path, name: str) -> None:
    _init(tmp_path / "k", None)
    os.chmod(tmp_path / "k" / name, 0o644)
    with pytest.raises(InsecurePermissionsError, match=rf"{name} is readable .* \(mode 0644\).*chmod 600"):
        load_keys(tmp_path / "k")


def test_open_key_directory_is_refused(tmp_path: Path) -> None:
    _init(tmp_path / "k", None)
    os.chmod(tmp_path / "k", 0o755)
    with pytest.raises(InsecurePermissionsError, match="chmod 700"):
        load_keys(tmp_path / "k")
    with pytest.raises(InsecurePermissionsError):  # nor written into
        _init(tmp_path / "k", None, force=True)


def test_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    _init(tmp_path / "real", None)
    _init(tmp_path / "k", None)
    (tmp_path / "k" / "node_key.json").unlink()
    (tmp_path / "k" / "node_key.json").symlink_to(tmp_path / "real" / "node_key.json")
    with pytest.raises(KeyStoreError, match="cannot open key file"):
        load_keys(tmp_path / "k")


def test_missing_files_say_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(keys.KeysNotFoundError, match="keys init"):
        load_keys(tmp_path / "nowhere")


def _edit(path: Path, change: dict[str, object], section: str | None = None) -> None:
    document = json.loads(path.read_text())
    (document[section] if section else document).update(change)
    path.write_text(json.dumps(document))


def test_altered_files_are_detected(tmp_path: Path) -> None:
    _init(tmp_path / "k")
    node = tmp_path / "k" / "node_key.json"
    original = node.read_text()
    _edit(node, {"public_key": "00" * 32})
    with pytest.raises(KeyFileFormatError, match="does not match the recorded public_key"):
        load_node_key(node, PASS)
    node.write_text(original)
    sealed = json.loads(original)["encryption"]["sealed"]
    _edit(node, {"sealed": sealed[:-2] + ("00" if sealed[-2:] != "00" else "01")}, "encryption")
    with pytest.raises(WrongPassphraseError):  # the MAC fails; nothing is returned
        load_node_key(node, PASS)


def test_hostile_kdf_costs_are_refused_before_running(tmp_path: Path) -> None:
    _init(tmp_path / "k")
    node, evm = tmp_path / "k" / "node_key.json", tmp_path / "k" / "evm_key.json"
    _edit(node, {"memlimit": 1 << 40}, "encryption")
    with pytest.raises(KeyFileFormatError, match="argon2id cost out of bounds"):
        load_node_key(node, PASS)
    document = json.loads(evm.read_text())
    document["crypto"]["kdfparams"]["n"] = 2**30
    evm.write_text(json.dumps(document))
    with pytest.raises(KeyFileFormatError, match="KDF cost out of bounds"):
        load_evm_account(evm, PASS)


def test_bad_inputs_change_nothing(tmp_path: Path) -> None:
    with pytest.raises(PassphraseRequiredError, match="empty passphrase"):
        init_keys(tmp_path / "k", "")
    with pytest.raises(KeyStoreError, match="not both"):
        init_keys(tmp_path / "k", PASS, insecure_plaintext=True)
    with pytest.raises(KeyFileFormatError, match="not a valid secp256k1 key"):
        init_keys(tmp_path / "k", None, insecure_plaintext=True, evm_private_key=bytes(32))
    with pytest.raises(KeyFileFormatError, match="exactly 32 bytes"):
        init_keys(tmp_path / "k", None, insecure_plaintext=True, node_seed=b"short")
    assert not (tmp_path / "k").exists()


def test_sign_and_verify() -> None:
    key = keys.NodeSigningKey(SEED)
    signature = key.sign(b"payload digest")
    assert len(signature) == 64
    assert signature == key.signing_key.sign(b"payload digest").signature  # what envelope.py uses
    assert verify(key.public_key, b"payload digest", signature)
    assert not verify(key.public_key, b"payload digesT", signature)
    assert not verify(keys.NodeSigningKey(bytes(32)).public_key, b"payload digest", signature)
    assert not verify(key.public_key, b"payload digest", signature[:63])
    assert not verify(key.public_key[:31], b"payload digest", signature)


def test_reprs_hide_private_keys(tmp_path: Path) -> None:
    loaded = _init(tmp_path / "k", None)
    for text in (repr(loaded), str(loaded), repr(loaded.node_key), repr(loaded.cosmos_account())):
        assert SEED.hex() not in text and EVM_KEY.hex() not in text.lower()
    assert loaded.node_public_key.hex() in repr(loaded)


def test_cosmos_address_is_backed_by_the_evm_key(tmp_path: Path) -> None:
    loaded = _init(tmp_path / "k", None)
    compressed = eth_keys.PrivateKey(EVM_KEY).public_key.to_compressed_bytes()
    assert loaded.cosmos_address == address_from_public_key(compressed)
    assert loaded.cosmos_address.startswith("gonka1")


def test_import_keeps_or_generates_the_partner_key(tmp_path: Path) -> None:
    imported, written = import_keys(tmp_path / "k", PASS, evm_private_key=EVM_KEY, kdf=INTERACTIVE_KDF)
    assert written == ["evm_key.json", "node_key.json"]  # the node key was generated
    assert imported.evm_address == Account.from_key(EVM_KEY).address
    with pytest.raises(KeysExistError):
        import_keys(tmp_path / "k", PASS, evm_private_key=EVM_KEY, kdf=INTERACTIVE_KDF)
    again, written = import_keys(tmp_path / "k", PASS, node_seed=SEED, force=True, kdf=INTERACTIVE_KDF)
    assert written == ["node_key.json"]
    assert again.evm_address == imported.evm_address  # kept
    loaded = load_keys(tmp_path / "k", PASS)
    assert loaded.node_key.export_seed() == SEED and loaded.evm_address == imported.evm_address


def test_parse_private_key_hex() -> None:
    assert keys.parse_private_key_hex(f"  0x{EVM_KEY.hex()}\n", "k") == EVM_KEY
    with pytest.raises(KeyFileFormatError, match="64 hex digits"):
        keys.parse_private_key_hex("abcd", "k")
    with pytest.raises(KeyFileFormatError, match="not hex digits") as info:
        keys.parse_private_key_hex("zz" * 32, "k")
    assert "zz" not in str(info.value)  # never echo what might be a key


# ---------------------------------------------------------------------------------------------- CLI


def _secret_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _secrets(key_dir: Path, passphrase: str | None) -> list[str]:
    loaded = load_keys(key_dir, passphrase)
    return [loaded.node_key.export_seed().hex(), bytes(loaded.evm_account.key).hex()]


def test_cli_init_and_show_print_identities_and_no_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_dir, pw = tmp_path / "k", _secret_file(tmp_path / "pw", PASS + "\n")
    common = ("--key-dir", str(key_dir), "--passphrase-file", str(pw))
    code, out, err = _run(capsys, "keys", "init", *common, "--kdf", "interactive")
    assert code == 0, err
    code, show_out, show_err = _run(capsys, "keys", "show", *common)
    assert code == 0, show_err
    loaded = load_keys(key_dir, PASS)  # the trailing newline of the file is not part of the passphrase
    for text in (out, show_out):
        assert loaded.node_public_key.hex() in text
        assert loaded.evm_address in text and loaded.cosmos_address in text
    for secret in _secrets(key_dir, PASS):
        assert secret not in (out + err + show_out + show_err).lower()
    code, json_out, _ = _run(capsys, "keys", "show", *common, "--json")
    assert json.loads(json_out) == {
        "key_dir": str(key_dir),
        "encrypted": True,
        "node_public_key": loaded.node_public_key.hex(),
        "evm_address": loaded.evm_address,
        "cosmos_address": loaded.cosmos_address,
    }


def test_cli_plaintext_show_needs_no_passphrase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_dir = tmp_path / "k"
    code, _, err = _run(capsys, "keys", "init", "--key-dir", str(key_dir), "--insecure-plaintext")
    assert code == 0 and "unencrypted" in err
    code, out, err = _run(capsys, "keys", "show", "--key-dir", str(key_dir))
    assert code == 0 and "PLAINTEXT" in out
    for secret in _secrets(key_dir, None):
        assert secret not in (out + err).lower()


def test_cli_refuses_world_readable_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_dir = tmp_path / "k"
    _init(key_dir, None)
    os.chmod(key_dir / "evm_key.json", 0o644)
    code, out, err = _run(capsys, "keys", "show", "--key-dir", str(key_dir))
    assert code == 2 and out == ""
    assert f"{key_dir / 'evm_key.json'} is readable or writable by group/others" in err


def test_cli_wrong_passphrase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _init(tmp_path / "k")
    bad = _secret_file(tmp_path / "pw", "nope")
    code, _, err = _run(
        capsys, "keys", "show", "--key-dir", str(tmp_path / "k"), "--passphrase-file", str(bad)
    )
    assert code == 2 and "node_key.json: wrong passphrase" in err


def test_cli_refuses_open_passphrase_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pw = _secret_file(tmp_path / "pw", PASS, mode=0o644)
    code, _, err = _run(
        capsys, "keys", "init", "--key-dir", str(tmp_path / "k"), "--passphrase-file", str(pw)
    )
    assert code == 2 and "chmod 600" in err and str(pw) in err
    assert not (tmp_path / "k").exists()


def test_cli_prompts_and_confirms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = iter([PASS, PASS + "typo"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    code, _, err = _run(capsys, "keys", "init", "--key-dir", str(tmp_path / "k"), "--kdf", "interactive")
    assert code == 2 and "passphrases differ" in err
    assert not (tmp_path / "k").exists()
    answers = iter([PASS, PASS, PASS])
    code, _, err = _run(capsys, "keys", "init", "--key-dir", str(tmp_path / "k"), "--kdf", "interactive")
    assert code == 0, err
    code, out, err = _run(capsys, "keys", "show", "--key-dir", str(tmp_path / "k"))
    assert code == 0 and load_keys(tmp_path / "k", PASS).evm_address in out


def test_cli_no_terminal_no_passphrase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def closed(prompt: str = "") -> str:
        raise EOFError

    monkeypatch.setattr("getpass.getpass", closed)
    code, _, err = _run(capsys, "keys", "init", "--key-dir", str(tmp_path / "k"))
    assert code == 2 and "--passphrase-file" in err


def test_cli_refuses_second_init_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("keys", "init", "--key-dir", str(tmp_path / "k"), "--insecure-plaintext")
    assert _run(capsys, *args)[0] == 0
    first = load_keys(tmp_path / "k").evm_address
    code, _, err = _run(capsys, *args)
    assert code == 2 and "already exist" in err and load_keys(tmp_path / "k").evm_address == first
    assert _run(capsys, *args, "--force")[0] == 0
    assert load_keys(tmp_path / "k").evm_address != first


def test_cli_import_from_file_and_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key_dir, pw = tmp_path / "k", _secret_file(tmp_path / "pw", PASS)
    evm_file = _secret_file(tmp_path / "evm.hex", "0x" + EVM_KEY.hex() + "\n")
    common = ("--key-dir", str(key_dir), "--passphrase-file", str(pw), "--kdf", "interactive")
    code, out, err = _run(capsys, "keys", "import", *common, "--evm-key", str(evm_file))
    assert code == 0, err
    assert "imported evm_key.json" in out and "generated node_key.json" in out
    assert EVM_KEY.hex() not in out + err
    monkeypatch.setattr("sys.stdin", io.StringIO(SEED.hex() + "\n"))
    code, out, err = _run(capsys, "keys", "import", *common, "--node-key", "-", "--force")
    assert code == 0, err
    assert "imported node_key.json" in out and "evm_key.json" not in out
    loaded = load_keys(key_dir, PASS)
    assert loaded.node_key.export_seed() == SEED
    assert loaded.evm_address == Account.from_key(EVM_KEY).address


def test_cli_import_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ("keys", "import", "--key-dir", str(tmp_path / "k"), "--insecure-plaintext")
    code, _, err = _run(capsys, *base)
    assert code == 2 and "--node-key FILE, --evm-key FILE" in err
    code, _, err = _run(capsys, *base, "--node-key", "-", "--evm-key", "-")
    assert code == 2 and "only one" in err
    bad = _secret_file(tmp_path / "bad.hex", "12" * 31)
    code, _, err = _run(capsys, *base, "--evm-key", str(bad))
    assert code == 2 and f"EVM key from {bad} must be 64 hex digits" in err
    code, _, err = _run(capsys, *base, "--evm-key", str(tmp_path / "missing.hex"))
    assert code == 2 and "missing.hex: cannot read EVM key file" in err
    assert not (tmp_path / "k").exists()


def test_cli_passphrase_from_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GONKA_KEY_PASSPHRASE", PASS)
    monkeypatch.setattr("getpass.getpass", lambda prompt="": pytest.fail("prompted despite the variable"))
    key_dir = str(tmp_path / "k")
    assert _run(capsys, "keys", "init", "--key-dir", key_dir, "--kdf", "interactive")[0] == 0
    assert (
        load_keys(tmp_path / "k", PASS).node_public_key.hex()
        in _run(capsys, "keys", "show", "--key-dir", key_dir)[1]
    )
    monkeypatch.setenv("GONKA_KEY_PASSPHRAZE", PASS)  # a typo fails loudly instead of being ignored
    code, _, err = _run(capsys, "keys", "show", "--key-dir", key_dir)
    assert code == 2 and "GONKA_KEY_PASSPHRAZE" in err
